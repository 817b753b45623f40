"""The drop report: every row a stream builder leaves out, counted per task, split and reason, logged once.

Counts live on the stream: `Task.dropped` (rows of the task's selection) and `TaskStream.unassigned` (rows of the
source in no task), both `split -> reason -> rows`; `TaskStream.dropped` joins them into one JSON-ready mapping
(task name, or `NO_TASK`, -> split -> reason -> rows). The reasons:

| reason | rows |
|---|---|
| `no caption` | an empty or missing caption (after stripping whitespace) |
| `no label` | a missing class label |
| `no timestamp` | a time stream's row without a value in the time column |
| `after the last time step` | a time stream's row after the last boundary, or in no group of values |
| `<column> value in no task` | a row whose column value is in none of the tasks' values (`stream_by_column`) |
| `class in no task` | a row whose class is in none of the class groups (`stream_by_class`) |
| `over max_train_per_task` / `over max_eval_per_task` | rows beyond the seeded subsample the limit asks for |
| `no caption in every language` | an eval image of a language stream without captions in all its languages |

A train split streamed from its source (`load_dataset(..., streaming=True)`) is not counted: its rows are skipped
as they are read. Errors (a missing image, an unknown label, a corrupt image) are never drops: they stop the build.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .task import NO_TASK, TaskStream

logger = logging.getLogger(__name__)

NO_CAPTION = "no caption"
NO_LABEL = "no label"
NO_TIMESTAMP = "no timestamp"
AFTER_LAST_STEP = "after the last time step"
CLASS_IN_NO_TASK = "class in no task"
NO_CAPTION_IN_EVERY_LANGUAGE = "no caption in every language"

SplitCounts = dict[str, dict[str, int]]  # split -> reason -> rows


def value_in_no_task(column: str) -> str:
    """The reason for rows whose `column` value is in none of a stream's tasks."""
    return f"{column} value in no task"


def over_limit(split: str) -> str:
    """The reason for rows left out by `max_<split>_per_task`."""
    return f"over max_{split}_per_task"


#: Reasons that are the user's own choice (a subsample), logged at INFO; every other reason is a WARNING.
LIMIT_REASONS = (over_limit("train"), over_limit("eval"))


def count(report: SplitCounts, split: str, reason: str, rows: int) -> None:
    """Add `rows` dropped rows of `split` for `reason` to `report` (zero counts are not stored)."""
    if rows > 0:
        reasons = report.setdefault(split, {})
        reasons[reason] = reasons.get(reason, 0) + int(rows)


def describe(stream: TaskStream, streamed_from_source: Iterable[str] = ()) -> str:
    """One line per task (and one for rows in no task) with its dropped rows by split and reason."""
    lines = []
    for task, splits in stream.dropped.items():
        parts = [
            f"{split}: " + ", ".join(f"{reason} {rows}" for reason, rows in reasons.items())
            for split, reasons in splits.items()
        ]
        label = "rows in no task" if task == NO_TASK else f"task {task!r}"
        lines.append(f"  {label}: " + "; ".join(parts))
    streamed = list(streamed_from_source)
    if streamed:
        lines.append(
            f"  train splits streamed from the source (not counted: rows without text or outside the task are "
            f"skipped as they are read): {', '.join(repr(name) for name in streamed)}"
        )
    return "\n".join(lines)


def log_dropped(stream: TaskStream, streamed_from_source: Iterable[str] = ()) -> None:
    """Log the drop report of a freshly built stream once: a WARNING when rows were dropped for a reason other
    than a subsample limit, else INFO."""
    text = describe(stream, streamed_from_source)
    if not text:
        return
    serious = any(
        reason not in LIMIT_REASONS
        for splits in stream.dropped.values()
        for reasons in splits.values()
        for reason in reasons
    )
    logger.log(logging.WARNING if serious else logging.INFO, "Stream %r left out rows:\n%s", stream.name, text)
