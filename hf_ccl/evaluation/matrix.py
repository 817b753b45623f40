"""The task-by-task results matrix of a continual run, with its derived metrics, JSON and markdown forms."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..compute import cost_table, cost_totals, task_records
from ..files import write_text_atomic
from .checks import NotEvaluatedWarning
from .continual_metrics import summarize

INITIAL_LABEL = "initial"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
FORMAT_VERSION = 1

DERIVED_DESCRIPTIONS = {
    "final_average": "mean over tasks after the last step",
    "average_incremental": "mean over steps of the mean over tasks seen so far",
    "forgetting": "mean drop from each task's best earlier score to its final score (Chaudhry et al. 2018)",
    "backward_transfer": "mean of final minus just-trained score on earlier tasks (Lopez-Paz & Ranzato 2017)",
    "forward_transfer": "mean of score before training a task minus the initial model's (Lopez-Paz & Ranzato 2017)",
    "initial_average": "mean over tasks of the initial model",
    "tic_id": "TiC-CLIP in-domain: mean of the diagonal",
    "tic_bwt": "TiC-CLIP backward: flat mean of the strict lower triangle",
    "tic_fwt": "TiC-CLIP forward: flat mean of the strict upper triangle",
    "tic_rel_bwt": "TiC-CLIP relative backward: lower triangle minus each row's diagonal",
    "tic_rel_fwt": "TiC-CLIP relative forward: upper triangle minus each row's diagonal",
    "mtil_transfer": "MTIL Transfer (ZSCL; X-TAIL's under class_scope all): per task j >= 1, the mean of its scores "
                     "before it is trained, averaged",
    "mtil_average": "MTIL Avg. (ZSCL; X-TAIL's under class_scope all): per task, the mean of its scores over all "
                    "steps, averaged",
    "mtil_last": "MTIL Last (ZSCL; X-TAIL's under class_scope all): the mean over tasks after the last step "
                 "(= final_average)",
    "class_incremental_average": "class-incremental Avg (iCaRL): mean over steps of the accuracy on every eval "
                                 "example seen so far, among the classes seen so far",
    "class_incremental_last": "class-incremental Last: that accuracy after the last step",
}


def _to_float(value: Any) -> float:
    """A metric value as float; None becomes NaN."""
    return math.nan if value is None else float(value)


def _json_safe(value: float) -> float | None:
    """NaN and infinities become None (JSON `null`)."""
    return value if math.isfinite(value) else None


@dataclass
class ResultsRow:
    """One evaluation of the model on (some of) the tasks: `metrics[task_name][metric_name] = value`.

    `evaluated=False` marks the row of a task after which the model was not evaluated (`eval_every`): no metrics,
    every cell NaN."""

    label: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    evaluated: bool = True

    def to_dict(self) -> dict[str, Any]:
        metrics = {
            task: {name: _json_safe(value) for name, value in values.items()}
            for task, values in self.metrics.items()
        }
        return {"label": self.label, "metrics": metrics, **({} if self.evaluated else {"evaluated": False})}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResultsRow:
        metrics = {
            task: {name: _to_float(value) for name, value in values.items()}
            for task, values in data.get("metrics", {}).items()
        }
        return cls(label=str(data["label"]), metrics=metrics, evaluated=bool(data.get("evaluated", True)))


class ResultsMatrix:
    """Rows of evaluations ("initial", then one per trained task) against columns of tasks.

    Each cell holds the full metric dict of a task; `headline()` reads one headline metric per task (`R_mean` for
    retrieval tasks, `accuracy` for classification tasks). Missing cells read as NaN.
    """

    def __init__(
        self, task_names: Sequence[str], headline_metrics: Sequence[str] | Mapping[str, str] | str = "R_mean"
    ):
        self.task_names = list(task_names)
        if len(set(self.task_names)) != len(self.task_names):
            raise ValueError(f"task names must be unique, got {self.task_names}")
        self.headline_metrics = self._resolve_headlines(headline_metrics)
        self.initial: ResultsRow | None = None
        self.rows: list[ResultsRow] = []
        #: What each trained task cost (`hf_ccl.compute.TaskCompute` as dicts), set by the loop.
        self.cost: list[dict[str, Any]] = []
        #: The run's start-up and initial evaluation (`hf_ccl.compute.RunPhases` as a dict), set by the loop.
        self.cost_run: dict[str, Any] | None = None
        #: How the rows were evaluated (`eval_every`, `eval_max_examples`, rows per task), set by the loop.
        self.evaluation: dict[str, Any] | None = None

    def _resolve_headlines(self, headline_metrics: Sequence[str] | Mapping[str, str] | str) -> list[str]:
        if isinstance(headline_metrics, str):
            return [headline_metrics] * len(self.task_names)
        if isinstance(headline_metrics, Mapping):
            return [headline_metrics[name] for name in self.task_names]
        metrics = list(headline_metrics)
        if len(metrics) != len(self.task_names):
            raise ValueError(f"{len(metrics)} headline metrics for {len(self.task_names)} tasks")
        return metrics

    @classmethod
    def from_tasks(cls, tasks: Iterable[Any]) -> ResultsMatrix:
        """An empty matrix for a stream of `Task`s, using each task's `headline_metric`."""
        tasks = list(tasks)
        return cls([task.name for task in tasks], [task.headline_metric for task in tasks])

    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def num_trained(self) -> int:
        return len(self.rows)

    def add_row(
        self, label: str, metrics_by_task: Mapping[str, Mapping[str, float]], *, evaluated: bool = True
    ) -> None:
        """Add the evaluation after training task `label` (or the initial model, `label="initial"`).

        `metrics_by_task` maps task names to metric dicts (tasks may be missing). A label that is already present is
        replaced in place, so re-evaluating after a resume does not duplicate a row. `evaluated=False` adds the row
        of a task after which the model was not evaluated (`eval_every`): it holds no metrics.
        """
        if not evaluated and (metrics_by_task or label == INITIAL_LABEL):
            raise ValueError("a row marked not evaluated holds no metrics (and the initial row is evaluated or absent)")
        unknown = set(metrics_by_task) - set(self.task_names)
        if unknown:
            raise ValueError(f"metrics for unknown tasks {sorted(unknown)}; tasks are {self.task_names}")
        metrics = {
            task: {name: _to_float(value) for name, value in values.items()}
            for task, values in metrics_by_task.items()
        }
        row = ResultsRow(label=label, metrics=metrics, evaluated=evaluated)
        if label == INITIAL_LABEL:
            self.initial = row
            return
        for index, existing in enumerate(self.rows):
            if existing.label == label:
                self.rows[index] = row
                return
        if len(self.rows) >= self.num_tasks:
            raise ValueError(
                f"already {len(self.rows)} trained rows for {self.num_tasks} tasks; cannot add {label!r}"
            )
        self.rows.append(row)

    def _headline_row(self, row: ResultsRow) -> np.ndarray:
        return np.array(
            [
                row.metrics.get(task, {}).get(metric, math.nan)
                for task, metric in zip(self.task_names, self.headline_metrics, strict=True)
            ],
            dtype=float,
        )

    def headline(self) -> np.ndarray:
        """Headline metric of every trained row on every task, shape `(num_trained, num_tasks)`; NaN if missing."""
        if not self.rows:
            return np.empty((0, self.num_tasks))
        return np.stack([self._headline_row(row) for row in self.rows])

    def initial_headline(self) -> np.ndarray | None:
        """Headline metric of the initial model on every task, or None without an initial row."""
        return None if self.initial is None else self._headline_row(self.initial)

    def metric(self, name: str) -> np.ndarray:
        """Any one metric (e.g. `"i2t_R@1"`) for every trained row and task; NaN where a task lacks it."""
        if not self.rows:
            return np.empty((0, self.num_tasks))
        return np.array(
            [[row.metrics.get(task, {}).get(name, math.nan) for task in self.task_names] for row in self.rows]
        )

    def summary(self) -> dict[str, float]:
        """`summarize` on the headline matrix of the rows so far (empty dict before the first trained row).

        With k trained rows and k < T tasks, the derived metrics use the square top-left k x k block (the first k
        tasks, as if the stream had stopped there) and the first k initial scores; unseen tasks are left out.
        A row that was not evaluated (`eval_every`) is NaN: every metric that reads one of its cells is NaN (null),
        without a `NotEvaluatedWarning` (the matrix records which rows were not evaluated). The cells are percentages
        (`scale="percent"`: a weak model's scores may all be below 1).
        """
        k = min(self.num_trained, self.num_tasks)
        if k == 0:
            return {}
        initial = self.initial_headline()
        sizes = self.eval_sizes()
        class_incremental = sizes is not None and all(m == "seen_accuracy" for m in self.headline_metrics[:k])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotEvaluatedWarning)
            return summarize(self.headline()[:k, :k], None if initial is None else initial[:k],
                             sizes[:k] if sizes is not None and class_incremental else None, scale="percent")

    def eval_sizes(self) -> list[int] | None:
        """Eval examples each task was scored on (from the recorded protocol), None when not recorded."""
        examples = (self.evaluation or {}).get("examples") or {}
        if not all(task in examples for task in self.task_names):
            return None
        return [int(examples[task]["evaluated"]) for task in self.task_names]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (NaN becomes None); the summary is included for readers but not read back."""
        return {
            "format_version": FORMAT_VERSION,
            "task_names": list(self.task_names),
            "headline_metrics": list(self.headline_metrics),
            "initial": None if self.initial is None else self.initial.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
            "summary": {name: _json_safe(value) for name, value in self.summary().items()},
            "cost": {"tasks": self.cost, "run": self.cost_run, **cost_totals(self.cost, self.cost_run)}
            if self.cost else None,
            "evaluation": self.evaluation,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResultsMatrix:
        """Rebuild a matrix from `to_dict` output (None values read back as NaN)."""
        matrix = cls(data["task_names"], data["headline_metrics"])
        if data.get("initial") is not None:
            matrix.initial = ResultsRow.from_dict(data["initial"])
        matrix.rows = [ResultsRow.from_dict(row) for row in data.get("rows", [])]
        matrix.cost = list((data.get("cost") or {}).get("tasks", []))
        matrix.cost_run = (data.get("cost") or {}).get("run")
        matrix.evaluation = data.get("evaluation")
        return matrix

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write `results.json` and `results.md` into `directory` (created if needed); return the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(directory / RESULTS_JSON, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        write_text_atomic(directory / RESULTS_MD, self.to_markdown())
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ResultsMatrix:
        """Read the `results.json` written by `save`."""
        with open(Path(directory) / RESULTS_JSON, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    def to_markdown(self) -> str:
        """A headline table (rows "initial", "after <task>"; cells with 1 decimal) and a derived-metrics table."""
        lines = ["## Results matrix", ""]
        lines += _headline_table(self)
        lines += ["", "## Derived metrics", ""]
        lines += _derived_table(self)
        table = cost_table(task_records(self.cost), self.cost_run)
        if table:
            lines += ["", "## Cost", ""] + table
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_markdown()

    def __repr__(self) -> str:
        return f"ResultsMatrix(tasks={self.task_names}, trained_rows={self.num_trained}, initial={self.initial is not None})"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _format(value: float, decimals: int) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{decimals}f}"


def _headline_table(matrix: ResultsMatrix) -> list[str]:
    header = ["model \\ eval task"] + [
        f"{_escape(task)} ({metric})"
        for task, metric in zip(matrix.task_names, matrix.headline_metrics, strict=True)
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    labelled: list[tuple[str, np.ndarray]] = []
    initial = matrix.initial_headline()
    if initial is not None:
        labelled.append((INITIAL_LABEL, initial))
    labelled += [
        (f"after {row.label}" + ("" if row.evaluated else " (not evaluated)"), values)
        for row, values in zip(matrix.rows, matrix.headline(), strict=True)
    ]
    for label, values in labelled:
        lines.append("| " + " | ".join([_escape(label)] + [_format(v, 1) for v in values]) + " |")
    lines += [
        "",
        "Cells: each task's headline metric in percent (R_mean = mean of R@1/5/10 in both directions; "
        "accuracy = zero-shot top-1; R@1 of a pair task = mean of both directions); `-` = not evaluated.",
    ]
    return lines + _evaluation_notes(matrix)


def _evaluation_notes(matrix: ResultsMatrix) -> list[str]:
    """What the evaluation protocol changes: skipped rows (`eval_every`), a subsample (`eval_max_examples`)."""
    notes: list[str] = []
    skipped = [row.label for row in matrix.rows if not row.evaluated]
    if skipped:
        every = (matrix.evaluation or {}).get("eval_every")
        notes.append(f"Not evaluated after {', '.join(skipped)}" + (f" (eval_every={every})" if every else "")
                     + ": the derived metrics that need those rows are `-` (null).")
    protocol = matrix.evaluation or {}
    if protocol.get("eval_max_examples") is not None:
        examples = protocol.get("examples", {})
        counts = ", ".join(f"{_escape(task)}: {n['evaluated']} of {n['rows']}" for task, n in examples.items())
        notes.append(f"Evaluated on a fixed seeded subsample of at most {protocol['eval_max_examples']} eval rows "
                     f"per task, the same rows in every row of the matrix ({counts}).")
    return ["", *notes] if notes else []


def _derived_table(matrix: ResultsMatrix) -> list[str]:
    summary = matrix.summary()
    if not summary:
        return ["No trained rows yet."]
    lines = ["| metric | value | meaning |", "|---|---|---|"]
    for name, value in summary.items():
        lines.append(f"| {name} | {_format(value, 2)} | {DERIVED_DESCRIPTIONS.get(name, '')} |")
    k = min(matrix.num_trained, matrix.num_tasks)
    if k < matrix.num_tasks:
        lines += [
            "",
            f"Computed on the first {k} of {matrix.num_tasks} tasks (the {k} x {k} block trained so far).",
        ]
    if len(set(matrix.headline_metrics)) > 1:
        lines += ["", "Averages mix headline metrics of different tasks (all in percent)."]
    return lines


