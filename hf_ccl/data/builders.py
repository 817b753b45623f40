"""Generic task-stream builders from any Hugging Face dataset.

A data source (`hf_ccl.data.sources`) is a `datasets.Dataset`, a `DatasetDict`, one `.parquet`/`.csv`/`.tsv`/
`.json`/`.jsonl` file, a local dataset folder, a `save_to_disk` folder or a Hub dataset id. Every builder converts
its rows to the canonical schema of `hf_ccl.data.task` (`hf_ccl.data.canonical`) and checks, before any training
starts, that the columns exist, that no task is empty and that every image path names a file (relative paths
resolve against the folder of the data file that holds them).

`max_train_per_task` / `max_eval_per_task` keep a seeded subsample of each task's rows, keyed by `seed`, the stream,
the task and the split (so a task keeps the same rows in every order and task list). A classification task's eval
split is stratified (`stratified_subsample`): an equal number of rows per class, at most `ceil(limit / K)` each; a
class with fewer rows gives all of them, so a subset of imbalanced data can hold fewer than `limit` rows. Train splits
and captioned (retrieval) eval splits are a random subsample (`subsample`).

Every row a builder leaves out is counted per task, split and reason on the stream (`TaskStream.dropped`) and
logged once (`hf_ccl.data.dropped`).

`streaming=True` (every builder) makes each task's `train` a `datasets.IterableDataset`; `eval` stays map-style:
- a path source (file, dataset folder, Hub id) is read with `load_dataset(..., streaming=True)` and filtered row by
  row (`hf_ccl.data.source_streams`): the same rows as without streaming, never read whole. Streamed rows have no
  row number: image ids come from `id_column` (`stream_by_time`) or a hash of the image; `max_train_per_task`
  keeps the first rows of the task; train rows are not counted in advance (an empty train split fails when the run
  starts), their drops are not counted, and `validate_images` checks eval splits only. A string label column needs
  `class_names` (the classes cannot be read from a stream in advance).
- a `Dataset`/`DatasetDict`/`save_to_disk` source, and `stream_random_split` on any source (a random equal split
  needs the row count, so the source is read once in full), are built as usual and then read from their Arrow
  files as `num_shards` shards (`hf_ccl.data.to_streaming`): the same rows and image ids as without streaming.
Task k's stream is shuffled with a buffer of `shuffle_buffer` rows and seed `seed + k` (None or 0: source order).
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from datasets import ClassLabel, Dataset, IterableDataset

from . import dropped as drops
from .canonical import (
    CANONICAL_FEATURES,
    DEFAULT_TRAIN_TEMPLATES,
    TextSpec,
    canonical_split,
    check_columns,
    column_values,
    label_lookup,
    quiet_progress_bars,
    remap_labels,
    resolve_class_names,
    to_canonical,
    usable_rows,
    validate_images,
)
from .images import PathBase
from .source_streams import RowFilter, canonical_stream, matching_strings, step_filter, where_filter
from .sources import (
    DatasetSource,
    image_base,
    is_path_source,
    is_single_split,
    load_split,
    local_path,
    reads_as_stream,
    source_name,
    stream_split,
)
from .streaming import DEFAULT_SHUFFLE_BUFFER, column_names, to_streaming
from .task import Task, TaskStream, get_task_kind
from .timesteps import TimeSteps, column_kind

__all__ = [
    "CANONICAL_FEATURES",
    "DEFAULT_TRAIN_TEMPLATES",
    "DatasetSource",
    "TaskSource",
    "TextSpec",
    "check_columns",
    "class_incremental_steps",
    "column_values",
    "group_name",
    "load_split",
    "quiet_progress_bars",
    "read_class_order",
    "remap_labels",
    "resolve_class_names",
    "source_name",
    "stream_by_class",
    "stream_by_column",
    "stream_by_time",
    "stream_class_incremental",
    "stream_from_datasets",
    "stream_random_split",
    "stratified_subsample",
    "subsample",
    "to_canonical",
    "usable_rows",
    "validate_images",
]


# ----------------------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TaskSource:
    """One task of an explicit stream (`stream_from_datasets`).

    `eval` defaults to `train` read at `eval_split` (for folders, Hub ids and `DatasetDict`s; a single file or
    `Dataset` holds one split, so it needs an `eval` of its own). `where` keeps only rows whose column equals the
    given value, or one of the given values when a list/tuple ({"domain": "sketch"}).
    """

    name: str
    train: DatasetSource
    eval: DatasetSource | None = None
    text_column: str | None = None
    label_column: str | None = None
    class_names: Sequence[str] | None = None
    train_templates: Sequence[str] | None = None
    eval_templates: Sequence[str] | None = None
    image_column: str = "image"
    train_split: str = "train"
    eval_split: str = "test"
    where: Mapping[str, Any] | None = None
    source: str | None = None
    #: The Hub dataset the eval data come from and its commit (`Task.dataset_id`); by default the eval source itself
    #: when it is a Hub id (not pinned: no revision).
    dataset_id: str | None = None
    dataset_revision: str | None = None

    @property
    def spec(self) -> TextSpec:
        return TextSpec(
            text_column=self.text_column,
            label_column=self.label_column,
            class_names=self.class_names,  # type: ignore[arg-type]
            train_templates=self.train_templates,  # type: ignore[arg-type]
            eval_templates=self.eval_templates,  # type: ignore[arg-type]
            image_column=self.image_column,
        )


@dataclass(frozen=True)
class _Options:
    """Options shared by every builder, checked before any data is read."""

    max_train_per_task: int | None = None
    max_eval_per_task: int | None = None
    seed: int = 0
    validate_images: bool = False
    streaming: bool = False
    num_shards: int = 1
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER

    def __post_init__(self) -> None:
        for name in ("max_train_per_task", "max_eval_per_task"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int) or self.num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer, got {self.num_shards!r}")
        buffer = self.shuffle_buffer
        if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0):
            raise ValueError(f"shuffle_buffer must be a non-negative integer or None, got {buffer!r}")
        for name in ("validate_images", "streaming"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def limit(self, split_role: str) -> int | None:
        return self.max_train_per_task if split_role == "train" else self.max_eval_per_task


def check_builder_options(values: dict[str, Any]) -> None:
    """The options every builder shares (subsample limits, shards, shuffle buffer, ...) among `values`, checked as
    the builders will check them, before any data is read: a `ValueError` naming the option."""
    _Options(**{f.name: values[f.name] for f in fields(_Options) if f.name in values})


@dataclass(frozen=True)
class _TimeStep:
    """The time step a task of a time stream keeps (for the row filter of a streamed train split)."""

    column: str
    steps: TimeSteps
    index: int


@dataclass
class _Resolved:
    """A task source with its datasets loaded and checked, ready to build."""

    name: str
    spec: TextSpec
    data: dict[str, Dataset]  # role ("train"/"eval") -> dataset; no "train" when it streams from its source
    splits: dict[str, str]  # role -> split name used in image ids and messages
    source: str
    class_names: list[str] | None
    bases: dict[str, PathBase]  # role -> where relative image paths resolve
    where: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # role -> restriction to these rows
    id_column: str | None = None  # image ids from this column's values instead of row numbers
    stream: IterableDataset | None = None  # the train split read from its source, when it streams
    time_step: _TimeStep | None = None
    dataset_id: str | None = None  # the Hub dataset of the eval data (TaskSource.dataset_id)
    dataset_revision: str | None = None


@dataclass
class _Columns:
    """Just enough of a dataset for `check_columns` (a stream's column names)."""

    column_names: list[str]


# ----------------------------------------------------------------------------------------------------------------
# Row selection
# ----------------------------------------------------------------------------------------------------------------


def _as_group(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]


def group_name(value: Any) -> str:
    """A task name for a column value or a group of values (`"2011+2012"`)."""
    return "+".join(str(v) for v in _as_group(value))


def _readable_values(dataset: Dataset, column: str) -> list[str]:
    feature = dataset.features[column]
    values = column_values(dataset, column)
    if isinstance(feature, ClassLabel):
        return [feature.int2str(v) if v is not None else "None" for v in values]
    return [str(v) for v in values]


def _rows_where(dataset: Dataset, column: str, value: Any) -> np.ndarray:
    """Rows whose `column` equals `value` (or one of a group); compared as strings, ClassLabel names allowed."""
    wanted = matching_strings(dataset.features[column], value)
    keep = [str(v) in wanted for v in column_values(dataset, column)]
    return np.flatnonzero(np.asarray(keep, dtype=bool)).astype(np.int64)


def _occurring(dataset: Dataset, column: str, limit: int = 30) -> str:
    counts = Counter(_readable_values(dataset, column)).most_common()
    shown = ", ".join(f"{value!r} ({count})" for value, count in counts[:limit])
    return shown + (f", ... ({len(counts) - limit} more)" if len(counts) > limit else "")


def _stable_seed(*parts: Any) -> int:
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def subsample(rows: np.ndarray, limit: int | None, seed: int, *key: Any) -> np.ndarray:
    """At most `limit` of `rows`, chosen by a seeded generator keyed by `key`, kept in their original order."""
    if limit is None or len(rows) <= limit:
        return rows
    rng = np.random.default_rng(_stable_seed(seed, *key))
    return np.sort(rows[rng.choice(len(rows), size=limit, replace=False)])


def stratified_subsample(rows: np.ndarray, labels: Sequence[Any], limit: int | None, seed: int, *key: Any) -> np.ndarray:
    """At most `limit` of `rows` (whose classes are `labels`), the same number per class where the data allows.

    Each class gets `limit // K` rows (K: the classes among `rows`) and `limit % K` classes, drawn at random among
    those with rows to spare, one more: no class holds more than `ceil(limit / K)` rows. A class with fewer rows
    gives all of them, and its unused share is not passed on, so the subset can hold fewer than `limit` rows (a
    majority class stays as large as the others). Which classes get the extra row and which rows each class keeps
    are drawn by a generator seeded as `subsample`'s (`seed` and `key`); the rows stay in their original order.
    """
    if limit is None or len(rows) <= limit:
        return rows
    rng = np.random.default_rng(_stable_seed(seed, *key))
    by_class: dict[Any, list[int]] = {}
    for position, label in enumerate(labels):
        by_class.setdefault(label, []).append(position)
    groups = [np.asarray(by_class[label]) for label in sorted(by_class, key=str)]
    base, extra = divmod(limit, len(groups))
    quota = np.asarray([min(len(group), base) for group in groups])
    spare = np.flatnonzero([len(group) > base for group in groups])
    if extra and len(spare):
        quota[rng.choice(spare, size=min(extra, len(spare)), replace=False)] += 1
    chosen = [group[rng.choice(len(group), size=n, replace=False)] for group, n in zip(groups, quota, strict=True)]
    return np.sort(rows[np.concatenate(chosen)])


def _split_subsample(stream: str, item: _Resolved, role: str, rows: np.ndarray, options: _Options) -> np.ndarray:
    """The rows a split keeps under its limit: a classification task's eval rows stratified by class
    (`stratified_subsample`), every other split at random (`subsample`); both keyed by stream, task and role."""
    limit, key = options.limit(role), (stream, item.name, role)
    if role != "eval" or not get_task_kind(item.spec.kind).has_classes or limit is None or len(rows) <= limit:
        return subsample(rows, limit, options.seed, *key)
    values = column_values(item.data[role], str(item.spec.label_column))
    return stratified_subsample(rows, [values[i] for i in rows], limit, options.seed, *key)


def _no_text(spec: TextSpec) -> str:
    return drops.NO_CAPTION if spec.text_column is not None else drops.NO_LABEL


def _count_outside(report: drops.SplitCounts, role: str, n_rows: int, kept: Sequence[np.ndarray], reason: str) -> None:
    """Count the rows of a split that none of the tasks' selections `kept` holds."""
    inside = np.unique(np.concatenate(kept)) if kept else np.empty(0, dtype=np.int64)
    drops.count(report, role, reason, n_rows - len(inside))


# ----------------------------------------------------------------------------------------------------------------
# Loading and checking
# ----------------------------------------------------------------------------------------------------------------


def _resolve(entry: TaskSource, *, stream_train: bool = False, columns: Sequence[str] = ()) -> _Resolved:
    """Load and check a task source before any task is built: both splits, or the eval split and a train stream
    (`stream_train`, for path sources); `columns` are further columns every split needs."""
    spec = entry.spec
    if entry.eval is None and is_single_split(entry.train):
        kind = "a Dataset" if isinstance(entry.train, Dataset) else f"{str(entry.train)!r}"
        raise ValueError(
            f"Task {entry.name!r}: give an eval dataset: train is {kind}, which holds a single split (a data file "
            "or Dataset has no test split to evaluate on); pass `eval` (a file, folder or dataset of its own)"
        )
    sources = {"train": entry.train, "eval": entry.eval if entry.eval is not None else entry.train}
    splits = {"train": entry.train_split, "eval": entry.eval_split}
    streamed = stream_train and reads_as_stream(entry.train)
    data = {role: load_split(sources[role], splits[role]) for role in (("eval",) if streamed else ("train", "eval"))}
    source = entry.source or source_name(entry.train)
    where = dict(entry.where or {})
    needed = [spec.image_column, spec.source_column, *where, *columns]
    for role, ds in data.items():
        check_columns(ds, needed, source=source, split=splits[role])
    stream = None
    if streamed:
        stream = stream_split(entry.train, splits["train"])
        check_columns(_Columns(column_names(stream)), needed, source=source, split=splits["train"])
    names = None
    if spec.label_column is not None:
        feature = data["eval"].features[spec.label_column]
        if streamed and spec.class_names is None and not isinstance(feature, ClassLabel):
            raise ValueError(
                f"Streaming {source!r}: pass class_names for label column {spec.label_column!r} (the classes "
                "cannot be read from a stream in advance)"
            )
        names = resolve_class_names(list(data.values()), spec.label_column, spec.class_names)
    bases = {role: image_base(sources[role], splits[role]) for role in ("train", "eval")}
    dataset_id, revision = entry.dataset_id, entry.dataset_revision
    if dataset_id is None and is_path_source(sources["eval"]) and local_path(sources["eval"]) is None:
        dataset_id = os.fspath(sources["eval"])  # a Hub id, read at its default branch
    return _Resolved(entry.name, spec, data, splits, source, names, bases, where, stream=stream,
                     dataset_id=dataset_id, dataset_revision=revision)


def _base_source(
    train: DatasetSource,
    eval: DatasetSource | None,
    spec_kwargs: dict[str, Any],
    splits: tuple[str, str],
    source: str | None,
    *,
    stream_train: bool = False,
    columns: Sequence[str] = (),
) -> _Resolved:
    """Load and check the shared train/eval datasets of a single-source stream once."""
    entry = TaskSource(
        name="", train=train, eval=eval, train_split=splits[0], eval_split=splits[1], source=source, **spec_kwargs
    )
    return _resolve(entry, stream_train=stream_train, columns=columns)


# ----------------------------------------------------------------------------------------------------------------
# Building tasks
# ----------------------------------------------------------------------------------------------------------------


def _empty_error(stream: str, item: _Resolved, role: str, reason: str) -> ValueError:
    ds, split = item.data[role], item.splits[role]
    message = f"Stream {stream!r}, task {item.name!r}, split {split!r} of dataset {item.source!r} is empty: {reason}."
    for column in item.where:
        message += f" Values that occur in {column!r}: {_occurring(ds, column)}."
    return ValueError(message)


def _task_rows(stream: str, item: _Resolved, role: str, report: drops.SplitCounts) -> np.ndarray:
    """The rows of one split that make up the task (restriction, `where` filters, usable text), or an error; rows
    of the selection without text are counted in `report`."""
    ds = item.data[role]
    rows = item.rows.get(role, np.arange(len(ds), dtype=np.int64))
    for column, value in item.where.items():
        rows = np.intersect1d(rows, _rows_where(ds, column, value))
        if len(rows) == 0:
            raise _empty_error(stream, item, role, f"no rows where {column} == {group_name(value)!r}")
    usable = np.intersect1d(rows, usable_rows(ds, item.spec))
    drops.count(report, role, _no_text(item.spec), len(rows) - len(usable))
    if len(usable) == 0:
        raise _empty_error(stream, item, role, f"no row has text in column {item.spec.source_column!r}")
    return usable


def _build_split(stream: str, item: _Resolved, role: str, options: _Options, report: drops.SplitCounts) -> Dataset:
    """One split of a task in the canonical schema (rows selected, subsampled, converted, optionally validated)."""
    rows = _task_rows(stream, item, role, report)
    chosen = _split_subsample(stream, item, role, rows, options)
    drops.count(report, role, drops.over_limit(role), len(rows) - len(chosen))
    built = canonical_split(
        item.data[role],
        source=item.source,
        split=item.splits[role],
        spec=item.spec,
        class_names=item.class_names,
        indices=chosen,
        id_column=item.id_column,
        base=item.bases[role],
    )
    if options.validate_images:
        validate_images(built, f"stream {stream!r}, task {item.name!r}, split {item.splits[role]!r}")
    return built


def _source_train(item: _Resolved, options: _Options, index: int) -> IterableDataset:
    """Task `index`'s train split read from its source as a stream (`hf_ccl.data.source_streams`)."""
    assert item.stream is not None
    features = item.stream.features or item.data["eval"].features
    filters: list[RowFilter] = [where_filter(c, features.get(c), value) for c, value in item.where.items()]
    if item.time_step is not None:
        filters.append(step_filter(item.time_step.column, item.time_step.steps, item.time_step.index))
    lookup = None
    if item.spec.label_column is not None:
        lookup = label_lookup(item.data["eval"], item.spec.label_column, item.class_names or [])
    return canonical_stream(
        item.stream,
        spec=item.spec,
        filters=filters,
        prefix=f"{item.source}/{item.splits['train']}/",
        base=item.bases["train"],
        class_names=item.class_names,
        lookup=lookup,
        id_column=item.id_column,
        limit=options.max_train_per_task,
        shuffle_buffer=options.shuffle_buffer,
        seed=options.seed + index,
    )


def _make_task(item: _Resolved, train: Dataset | IterableDataset, eval: Dataset, report: drops.SplitCounts) -> Task:
    return Task(
        name=item.name,
        train=train,
        eval=eval,
        kind=item.spec.kind,
        class_names=item.class_names,
        eval_templates=list(item.spec.eval_templates or item.spec.templates) if item.class_names else None,
        train_templates=list(item.spec.templates) if item.class_names else None,
        source=item.source,
        dropped=report,
        dataset_id=item.dataset_id,
        dataset_revision=item.dataset_revision,
    )


def _build_stream(
    name: str, items: Sequence[_Resolved], options: _Options, unassigned: drops.SplitCounts | None = None
) -> TaskStream:
    tasks = []
    for index, item in enumerate(items):
        report: drops.SplitCounts = {}
        if item.stream is not None:
            train: Dataset | IterableDataset = _source_train(item, options, index)
        else:
            train = _build_split(name, item, "train", options, report)
        tasks.append(_make_task(item, train, _build_split(name, item, "eval", options, report), report))
    return TaskStream(name=name, tasks=tasks, unassigned=unassigned or {})


def _finish(stream: TaskStream, items: Sequence[_Resolved], options: _Options) -> TaskStream:
    """Stream the train splits still in memory (`streaming`), and log the drop report once."""
    if options.streaming:
        stream = to_streaming(stream, num_shards=options.num_shards, shuffle_buffer=options.shuffle_buffer,
                              seed=options.seed)
    drops.log_dropped(stream, [item.name for item in items if item.stream is not None])
    return stream


def _as_source(entry: TaskSource | Mapping[str, Any] | Sequence[Any]) -> TaskSource:
    if isinstance(entry, TaskSource):
        return entry
    if isinstance(entry, Mapping):
        return TaskSource(**entry)
    name, train, eval_data, *rest = entry
    options = dict(rest[0]) if rest else {}
    return TaskSource(name=name, train=train, eval=eval_data, **options)


# ----------------------------------------------------------------------------------------------------------------
# Public builders
# ----------------------------------------------------------------------------------------------------------------


def stream_from_datasets(
    entries: Sequence[TaskSource | Mapping[str, Any] | Sequence[Any]],
    *,
    name: str = "stream",
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """One task per entry, in order. An entry is a `TaskSource`, a mapping of its fields (e.g. from YAML), or a
    tuple `(name, train, eval, {text spec...})`. All sources are loaded and checked before any task is built.
    `streaming`: see the module docstring (an entry's `where` filters a streamed train split row by row)."""
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    items = [_resolve(_as_source(entry), stream_train=streaming) for entry in entries]
    return _finish(_build_stream(name, items, options), items, options)


def stream_by_column(
    train: DatasetSource,
    eval: DatasetSource | None,
    column: str,
    values: Sequence[Any],
    *,
    name: str | None = None,
    task_names: Sequence[str] | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    eval_templates: Sequence[str] | None = None,
    image_column: str = "image",
    train_split: str = "train",
    eval_split: str = "test",
    source: str | None = None,
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """One task per value of `column`, in the given order (domain, category, year, language...).

    A value may be a list/tuple of values grouped into one task. Values match as strings (so `2011` and `"2011"`
    both select a year), and a `ClassLabel` column matches its names as well as its indices. Rows whose value is
    in no task are counted as dropped (`"<column> value in no task"`). `streaming`: see the module docstring.
    """
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    spec = dict(text_column=text_column, label_column=label_column, class_names=class_names,
                      train_templates=train_templates, eval_templates=eval_templates, image_column=image_column)
    base = _base_source(train, eval, spec, (train_split, eval_split), source, stream_train=streaming,
                        columns=[column])
    names = list(task_names) if task_names is not None else [group_name(v) for v in values]
    if len(names) != len(values):
        raise ValueError(f"task_names has {len(names)} names for {len(values)} values")
    unassigned: drops.SplitCounts = {}
    for role, ds in base.data.items():
        kept = [_rows_where(ds, column, value) for value in values]
        _count_outside(unassigned, role, len(ds), kept, drops.value_in_no_task(column))
    items = [replace(base, name=task, where={column: value}) for task, value in zip(names, values, strict=True)]
    stream = _build_stream(name or f"{base.source}-by-{column}", items, options, unassigned)
    return _finish(stream, items, options)


def _equal_parts(n_rows: int, n_tasks: int, seed: int, key: str) -> list[np.ndarray]:
    rng = np.random.default_rng(_stable_seed(seed, "random-split", key))
    return [np.sort(part) for part in np.array_split(rng.permutation(n_rows), n_tasks)]


def stream_random_split(
    train: DatasetSource,
    eval: DatasetSource | None,
    n_tasks: int,
    seed: int = 0,
    *,
    name: str | None = None,
    task_names: Sequence[str] | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    eval_templates: Sequence[str] | None = None,
    image_column: str = "image",
    train_split: str = "train",
    eval_split: str = "test",
    source: str | None = None,
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    validate_images: bool = False,
) -> TaskStream:
    """A random equal split of train and of eval into `n_tasks` disjoint parts (the Mod-X protocol).

    Rows without text are left out first (counted as dropped, in no task); part sizes differ by at most one. The
    split depends only on `seed`. `streaming=True` reads the source once in full (the split needs its row count),
    then streams each task's train rows from the Arrow files (`to_streaming`): the same rows and image ids.
    """
    if isinstance(n_tasks, bool) or not isinstance(n_tasks, int) or n_tasks < 1:
        raise ValueError(f"n_tasks must be a positive integer, got {n_tasks!r}")
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    spec = dict(text_column=text_column, label_column=label_column, class_names=class_names,
                      train_templates=train_templates, eval_templates=eval_templates, image_column=image_column)
    base = _base_source(train, eval, spec, (train_split, eval_split), source)
    names = list(task_names) if task_names is not None else [f"{base.source}-{i}" for i in range(n_tasks)]
    if len(names) != n_tasks:
        raise ValueError(f"task_names has {len(names)} names for {n_tasks} tasks")
    parts: dict[str, list[np.ndarray]] = {}
    unassigned: drops.SplitCounts = {}
    for role, ds in base.data.items():
        rows = usable_rows(ds, base.spec)
        if len(rows) < n_tasks:
            raise ValueError(
                f"Dataset {base.source!r}, split {base.splits[role]!r} has {len(rows)} usable rows, "
                f"fewer than n_tasks={n_tasks}"
            )
        drops.count(unassigned, role, _no_text(base.spec), len(ds) - len(rows))
        parts[role] = [rows[part] for part in _equal_parts(len(rows), n_tasks, seed, role)]
    items = [
        replace(base, name=task, rows={role: parts[role][i] for role in parts}) for i, task in enumerate(names)
    ]
    stream = _build_stream(name or f"{base.source}-random{n_tasks}", items, options, unassigned)
    return _finish(stream, items, options)


def stream_by_class(
    train: DatasetSource,
    eval: DatasetSource | None,
    class_groups: Sequence[Sequence[int | str]],
    *,
    label_column: str = "label",
    label_space: str = "task",
    name: str | None = None,
    task_names: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    eval_templates: Sequence[str] | None = None,
    image_column: str = "image",
    train_split: str = "train",
    eval_split: str = "test",
    source: str | None = None,
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """Class-incremental stream: one classification task per group of classes (indices or names).

    `label_space="task"`: each task's `class_names` are its own classes and labels index them (zero-shot among the
    task's classes). `label_space="all"`: every task keeps all class names and global labels. Rows of classes in
    no group, and rows without a label, are counted as dropped. `streaming`: see the module docstring.
    """
    if label_space not in ("task", "all"):
        raise ValueError(f"label_space must be 'task' or 'all', got {label_space!r}")
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    spec = dict(label_column=label_column, class_names=class_names, train_templates=train_templates,
                      eval_templates=eval_templates, image_column=image_column)
    base = _base_source(train, eval, spec, (train_split, eval_split), source, stream_train=streaming)
    all_names = base.class_names or []
    groups = [[_class_index(c, all_names) for c in group] for group in class_groups]
    default_names = ["+".join(all_names[i] for i in group) for group in groups]
    names = list(task_names) if task_names is not None else default_names
    if len(names) != len(groups):
        raise ValueError(f"task_names has {len(names)} names for {len(groups)} class groups")
    by_name = label_lookup(base.data["eval"], label_column, all_names) is not None  # a column of class names
    selections = [[all_names[i] for i in group] if by_name else group for group in groups]
    unassigned: drops.SplitCounts = {}
    for role, ds in base.data.items():
        labelled = usable_rows(ds, base.spec)
        drops.count(unassigned, role, drops.NO_LABEL, len(ds) - len(labelled))
        kept = [_rows_where(ds, label_column, selection) for selection in selections]
        _count_outside(unassigned, role, len(labelled), kept, drops.CLASS_IN_NO_TASK)
    items = [
        replace(base, name=task, where={label_column: selection})
        for task, selection in zip(names, selections, strict=True)
    ]
    stream = _build_stream(name or f"{base.source}-classes{len(groups)}", items, options, unassigned)
    if label_space == "task":
        for task, group in zip(stream.tasks, groups, strict=True):
            _localise_labels(task, group, all_names)
    return _finish(stream, items, options)


def _class_index(value: int | str, class_names: Sequence[str]) -> int:
    if isinstance(value, str):
        if value not in class_names:
            raise ValueError(f"Unknown class {value!r}; classes: {', '.join(class_names)}")
        return list(class_names).index(value)
    if not 0 <= int(value) < len(class_names):
        raise ValueError(f"Class index {value} out of range for {len(class_names)} classes")
    return int(value)


def _localise_labels(task: Task, group: Sequence[int], all_names: Sequence[str]) -> None:
    mapping = {global_index: local for local, global_index in enumerate(group)}
    task.class_names = [all_names[i] for i in group]
    task.train = remap_labels(task.train, mapping)
    task.eval = remap_labels(task.eval, mapping)


# ----------------------------------------------------------------------------------------------------------------
# Time streams (TiC-CLIP)
# ----------------------------------------------------------------------------------------------------------------


def _step_counts(names: Sequence[str], assigned: np.ndarray) -> str:
    counts = np.bincount(assigned + 1, minlength=len(names) + 1)
    text = ", ".join(f"{name}: {count}" for name, count in zip(names, counts[1:], strict=True))
    return text + f"; in no step (after the last boundary or no timestamp): {counts[0]}"


def _empty_step_error(stream: str, source: str, names: Sequence[str], empty: tuple[str, str],
                      counts: Mapping[str, np.ndarray]) -> ValueError:
    step, split = empty
    per_split = " ".join(f"Rows per step in split {s!r}: {_step_counts(names, a)}." for s, a in counts.items())
    return ValueError(
        f"Stream {stream!r}: time step {step!r} has no rows in split {split!r} of dataset {source!r}; change the "
        f"boundaries so that every step has data. {per_split}"
    )


def _check_unique_ids(dataset: Dataset, id_column: str, source: str, split: str) -> None:
    values = column_values(dataset, id_column)
    if len(set(values)) < len(values):
        repeated = [value for value, count in Counter(values).most_common(5) if count > 1]
        raise ValueError(f"Dataset {source!r}, split {split!r}: id_column {id_column!r} repeats values {repeated}")


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def stream_by_time(
    train: DatasetSource,
    eval: DatasetSource | None,
    time_column: str,
    boundaries: Sequence[Any],
    *,
    name: str | None = None,
    task_names: Sequence[str] | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    eval_templates: Sequence[str] | None = None,
    image_column: str = "image",
    id_column: str | None = None,
    train_split: str = "train",
    eval_split: str = "test",
    source: str | None = None,
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """One task per time step of `time_column` (TiC-CLIP): train from the train split and eval from the eval split
    of the same step.

    `boundaries` are step end points `[b0, b1, ...]` (step 0: `t <= b0`; step i: `b_{i-1} < t <= b_i`) or explicit
    groups of values `[[2010, 2011], [2012], ...]`. **Rows after the last boundary (or in no group) and rows without
    a timestamp are dropped** (and counted: `after the last time step`, `no timestamp`): the stream ends at its last
    step, as TiC-CLIP leaves out years after its last one.
    The time column holds numbers (years) or dates (Arrow timestamps/dates, or ISO-8601 strings); on dates a
    boundary names a whole period (`2011` or `"2011"`: up to the end of 2011); see `hf_ccl.data.timesteps`.
    Default task names: `"2011"`, `"2013-2015"` for year steps (the first step named by its last year).
    A step without rows in either split is an error that lists the rows per step.

    `id_column`: image ids `"<source>/<split>/<value>"` from this column (unique per split) instead of row numbers.
    `streaming`: see the module docstring; a path source is filtered on the time column once per step (each step
    reads the whole source).
    """
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    spec = dict(text_column=text_column, label_column=label_column, class_names=class_names,
                      train_templates=train_templates, eval_templates=eval_templates, image_column=image_column)
    base = _base_source(train, eval, spec, (train_split, eval_split), source, stream_train=streaming,
                        columns=[time_column, *([id_column] if id_column else [])])
    base = replace(base, id_column=id_column)
    if id_column is not None:
        for role, ds in base.data.items():
            _check_unique_ids(ds, id_column, base.source, base.splits[role])
    steps = TimeSteps.parse(boundaries, column_kind(base.data["eval"].features, time_column))
    names = list(task_names) if task_names is not None else steps.names()
    if len(names) != len(steps):
        raise ValueError(f"task_names has {len(names)} names for {len(steps)} time steps")
    stream_name = name or f"{base.source}-by-{time_column}"
    rows, counts = {}, {}
    unassigned: drops.SplitCounts = {}
    for role, ds in base.data.items():
        times = column_values(ds, time_column)
        assigned = steps.assign(times)
        rows[role], counts[base.splits[role]] = [np.flatnonzero(assigned == i) for i in range(len(steps))], assigned
        missing = sum(_is_missing(value) for value in times)
        drops.count(unassigned, role, drops.NO_TIMESTAMP, missing)
        drops.count(unassigned, role, drops.AFTER_LAST_STEP, int(np.sum(assigned < 0)) - missing)
    for role, per_step in rows.items():
        for step_name, step_rows in zip(names, per_step, strict=True):
            if len(step_rows) == 0:
                raise _empty_step_error(stream_name, base.source, names, (step_name, base.splits[role]), counts)
    items = [
        replace(base, name=task, rows={role: rows[role][i] for role in rows},
                time_step=_TimeStep(time_column, steps, i))
        for i, task in enumerate(names)
    ]
    return _finish(_build_stream(stream_name, items, options, unassigned), items, options)


# ----------------------------------------------------------------------------------------------------------------
# Class-incremental splits (CIFAR-100 10-10, TinyImageNet 100-10, ...)
# ----------------------------------------------------------------------------------------------------------------

CLASS_ORDER_SUFFIXES = (".yaml", ".yml", ".json")


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def read_class_order(path: str | Path) -> list[int | str]:
    """A class order from a YAML or JSON file: a bare list, or a mapping with a `class_order` list (the layout of
    MoE-Adapters' `cil/class_orders/*.yaml`)."""
    from ..safe_yaml import load_yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"class_order: no such file {str(path)!r} (a YAML/JSON file with a `class_order` list)")
    with open(path, encoding="utf-8") as handle:
        data = load_yaml(handle, f"class_order file {str(path)!r}")  # JSON is YAML
    if isinstance(data, Mapping):
        if "class_order" not in data:
            raise ValueError(f"class_order: file {str(path)!r} has no `class_order` key (keys: {', '.join(data)})")
        data = data["class_order"]
    if not isinstance(data, list) or not data:
        raise ValueError(f"class_order: file {str(path)!r} must hold a non-empty list of classes, got {data!r:.80}")
    return data


def class_incremental_steps(
    class_names: Sequence[str],
    classes_per_step: int,
    *,
    initial_classes: int | None = None,
    class_order: str | Path | Sequence[int | str] | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """The class indices of each step of a class-incremental split (see `stream_class_incremental`); every option
    is checked, and an error names it."""
    n_classes = len(class_names)
    if not _is_count(classes_per_step) or classes_per_step < 1:
        raise ValueError(f"classes_per_step must be a positive integer, got {classes_per_step!r}")
    if initial_classes is not None and (not _is_count(initial_classes) or initial_classes < 1):
        raise ValueError(f"initial_classes must be a positive integer or None, got {initial_classes!r}")
    if class_order is None:
        order = list(range(n_classes))
    elif isinstance(class_order, str) and class_order == "seed":
        order = np.random.default_rng(_stable_seed(seed, "class-order")).permutation(n_classes).tolist()
    elif isinstance(class_order, (str, Path)):
        if not str(class_order).lower().endswith(CLASS_ORDER_SUFFIXES):
            raise ValueError(
                f"class_order must be None, 'seed', a list of class indices or names, or a .yaml/.json file; "
                f"got {class_order!r}"
            )
        order = _order_indices(read_class_order(class_order), class_names)
    elif isinstance(class_order, Sequence):
        order = _order_indices(class_order, class_names)
    else:
        raise ValueError(f"class_order must be None, 'seed', a list or a file, got {type(class_order).__name__}")
    first = classes_per_step if initial_classes is None else initial_classes
    if first > len(order):
        raise ValueError(
            f"{'initial_classes' if initial_classes is not None else 'classes_per_step'}={first} is more than the "
            f"{len(order)} classes of class_order"
        )
    rest = len(order) - first
    if rest % classes_per_step:
        what = f"the {rest} classes after the first step's {first}" if initial_classes is not None else (
            f"the {len(order)} classes")
        raise ValueError(f"classes_per_step={classes_per_step} does not divide {what}")
    return [order[:first]] + [order[i:i + classes_per_step] for i in range(first, len(order), classes_per_step)]


def _order_indices(order: Sequence[Any], class_names: Sequence[str]) -> list[int]:
    """A class order of indices and/or names as indices, each class once."""
    if isinstance(order, (str, bytes)) or len(order) == 0:
        raise ValueError(f"class_order must be a non-empty list of class indices or names, got {order!r}")
    indices = []
    for value in order:
        if isinstance(value, str):
            if value not in class_names:
                raise ValueError(f"class_order: unknown class {value!r}; classes: {', '.join(class_names)}")
            indices.append(list(class_names).index(value))
        elif _is_count(value):
            if not 0 <= int(value) < len(class_names):
                raise ValueError(f"class_order: class index {value} out of range for {len(class_names)} classes")
            indices.append(int(value))
        else:
            raise ValueError(f"class_order: {value!r} is neither a class index nor a class name")
    repeated = [class_names[i] for i, count in Counter(indices).items() if count > 1]
    if repeated:
        raise ValueError(f"class_order names a class twice: {', '.join(repeated)}")
    return indices


def stream_class_incremental(
    train: DatasetSource,
    classes_per_step: int,
    *,
    eval: DatasetSource | None = None,
    initial_classes: int | None = None,
    class_order: str | Sequence[int | str] | None = None,
    label_column: str = "label",
    label_space: str = "task",
    name: str | None = None,
    task_names: Sequence[str] | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    eval_templates: Sequence[str] | None = None,
    image_column: str = "image",
    train_split: str = "train",
    eval_split: str = "test",
    source: str | None = None,
    streaming: bool = False,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """Class-incremental split of one labelled dataset: `classes_per_step` classes per task (CIFAR-100 "10-10"),
    optionally a larger first task of `initial_classes` (TinyImageNet "100-10": `initial_classes=100,
    classes_per_step=10`). Built on `stream_by_class`.

    `class_order`: the order classes are introduced in. `None`: the dataset's own order (0, 1, ...); `"seed"`: a
    permutation seeded by `seed` (the same seed also seeds the subsamples); a list of class indices and/or names;
    or a `.yaml`/`.json` file holding such a list or a mapping with a `class_order` list (MoE-Adapters'
    `cil/class_orders/cifar100.yaml`). Each class may appear once; classes left out of the order are in no task
    (their rows counted as dropped, `class in no task`). `classes_per_step` must divide the classes after the
    first step. Every option is checked before any task is built; an error names the option.

    `label_space="task"` (default): each task's `class_names` are its own classes (task-incremental zero-shot;
    class-incremental scoring among all classes seen so far is the evaluator's business).
    `label_space="all"`: every task keeps all class names and global labels. Default task names:
    `"<source>-<k>"`. The other options are `stream_by_class`'s.
    """
    if label_space not in ("task", "all"):
        raise ValueError(f"label_space must be 'task' or 'all', got {label_space!r}")
    options = _Options(max_train_per_task, max_eval_per_task, seed, validate_images, streaming, num_shards,
                       shuffle_buffer)
    spec = dict(label_column=label_column, class_names=class_names, train_templates=train_templates,
                eval_templates=eval_templates, image_column=image_column)
    base = _base_source(train, eval, spec, (train_split, eval_split), source, stream_train=streaming)
    all_names = base.class_names or []
    groups = class_incremental_steps(all_names, classes_per_step, initial_classes=initial_classes,
                                     class_order=class_order, seed=options.seed)
    if task_names is not None and len(task_names) != len(groups):
        raise ValueError(f"task_names has {len(task_names)} names for {len(groups)} steps")
    return stream_by_class(
        train,
        eval,
        groups,
        label_column=label_column,
        label_space=label_space,
        name=name or f"{base.source}-{len(groups[0])}-{classes_per_step}",
        task_names=list(task_names) if task_names is not None else [f"{base.source}-{k}" for k in range(len(groups))],
        class_names=class_names,
        train_templates=train_templates,
        eval_templates=eval_templates,
        image_column=image_column,
        train_split=train_split,
        eval_split=eval_split,
        source=base.source,
        streaming=streaming,
        num_shards=num_shards,
        shuffle_buffer=shuffle_buffer,
        max_train_per_task=max_train_per_task,
        max_eval_per_task=max_eval_per_task,
        seed=seed,
        validate_images=validate_images,
    )
