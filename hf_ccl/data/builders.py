"""Generic task-stream builders from any Hugging Face dataset.

A data source is a `datasets.Dataset`, a `DatasetDict`, a local dataset folder or a Hub dataset id (the last two are
read with `datasets.load_dataset(path, split=...)`). Every builder converts its rows to the canonical schema of
`hf_ccl.data.task` and checks, before any training starts, that the columns exist and that no task is empty.

Text comes either from a caption column (a string or a list of strings per row: a retrieval task) or from a class
label put through prompt templates (a classification task, scored zero-shot over `class_names` with the
`eval_templates` ensemble).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, IterableDataset, List, Value, load_dataset
from datasets import Image as ImageFeature
from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

from .images import decode_image
from .streaming import DEFAULT_SHUFFLE_BUFFER, column_names, shuffled, to_streaming
from .task import Task, TaskKind, TaskStream
from .templates import format_template
from .timesteps import TimeSteps, column_kind

DatasetSource = Dataset | DatasetDict | str | os.PathLike
DEFAULT_TRAIN_TEMPLATES = ("a photo of a {label}.",)
CANONICAL_FEATURES = Features(
    {
        "image": ImageFeature(decode=False),
        "texts": List(Value("string")),
        "image_id": Value("string"),
        "label": Value("int64"),
    }
)
_QUIET_BELOW_ROWS = 20_000  # no progress bars for the small maps of a typical task


# ----------------------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSpec:
    """Where a task's text comes from: exactly one of a caption column or a class-label column."""

    text_column: str | None = None
    label_column: str | None = None
    class_names: tuple[str, ...] | None = None
    train_templates: tuple[str, ...] | None = None
    eval_templates: tuple[str, ...] | None = None
    image_column: str = "image"

    def __post_init__(self) -> None:
        if (self.text_column is None) == (self.label_column is None):
            raise ValueError("Give exactly one of text_column (captions) or label_column (class labels)")
        for name in ("class_names", "train_templates", "eval_templates"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(f"{name} must be a list of strings, not a single string")
            if value is not None:
                object.__setattr__(self, name, tuple(value))

    @property
    def kind(self) -> TaskKind:
        return "retrieval" if self.text_column is not None else "classification"

    @property
    def source_column(self) -> str:
        return self.text_column if self.text_column is not None else str(self.label_column)

    @property
    def templates(self) -> tuple[str, ...]:
        return self.train_templates or DEFAULT_TRAIN_TEMPLATES


@dataclass
class TaskSource:
    """One task of an explicit stream (`stream_from_datasets`).

    `eval` defaults to `train` read at `eval_split` (for paths, Hub ids and `DatasetDict`s). `where` keeps only
    rows whose column equals the given value, or one of the given values when a list/tuple ({"domain": "sketch"}).
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
class _Limits:
    """Options shared by every builder."""

    max_train_per_task: int | None = None
    max_eval_per_task: int | None = None
    seed: int = 0
    validate_images: bool = False

    def limit(self, split_role: str) -> int | None:
        return self.max_train_per_task if split_role == "train" else self.max_eval_per_task


@dataclass
class _Resolved:
    """A task source with its datasets loaded and checked, ready to build."""

    name: str
    spec: TextSpec
    data: dict[str, Dataset]  # role ("train"/"eval") -> dataset
    splits: dict[str, str]  # role -> split name used in image ids and messages
    source: str
    class_names: list[str] | None
    where: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # role -> restriction to these rows
    id_column: str | None = None  # image ids from this column's values instead of row numbers


# ----------------------------------------------------------------------------------------------------------------
# Loading and checking
# ----------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _load_path(path: str, split: str) -> Dataset:
    return load_dataset(path, split=split)


def load_split(data: DatasetSource, split: str) -> Dataset:
    """One split of a data source: a `Dataset` as is, a `DatasetDict`'s split, or `load_dataset(path, split=split)`."""
    if isinstance(data, Dataset):
        return data
    if isinstance(data, DatasetDict):
        if split not in data:
            raise KeyError(f"DatasetDict has no split {split!r}; splits: {', '.join(data)}")
        return data[split]
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        cached = _load_path(str(Path(path).resolve()) if os.path.exists(path) else path, split)
        return cached.with_format(None)  # a fresh object: callers may set formats without touching the cache
    raise TypeError(f"Unsupported data source of type {type(data).__name__}")


def source_name(data: DatasetSource, default: str = "dataset") -> str:
    """A short name for a data source, used in image ids and error messages (a folder's name, a Hub id)."""
    if isinstance(data, (str, os.PathLike)):
        path = os.fspath(data)
        return Path(path).resolve().name if os.path.exists(path) else path
    if isinstance(data, DatasetDict):
        data = next(iter(data.values()))
    return data.info.dataset_name or default


def check_columns(dataset: Dataset, columns: Sequence[str], *, source: str, split: str) -> None:
    """Raise a `KeyError`-like `ValueError` naming dataset, split, the missing column and the existing columns."""
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(
            f"Dataset {source!r}, split {split!r} has no column {', '.join(repr(c) for c in missing)}; "
            f"its columns are: {', '.join(dataset.column_names)}"
        )


def column_values(dataset: Dataset, column: str) -> list[Any]:
    """A column as a Python list, read through Arrow (fast, no image decoding; respects `select`)."""
    return dataset.with_format("arrow")[column].to_pylist()


def resolve_class_names(
    datasets: Sequence[Dataset], label_column: str, class_names: Sequence[str] | None = None
) -> list[str]:
    """Class names of a label column: a `ClassLabel`'s names, the given names, or a string column's sorted values.

    With a `ClassLabel` or integer column, `class_names` (if given) are the display names of indices 0..K-1; with a
    string column they fix the class order (default: sorted values over all given datasets).
    """
    feature = datasets[0].features[label_column]
    if isinstance(feature, ClassLabel):
        if class_names is not None and len(class_names) != feature.num_classes:
            raise ValueError(
                f"class_names has {len(class_names)} names but column {label_column!r} has {feature.num_classes}"
            )
        return list(class_names) if class_names is not None else list(feature.names)
    dtype = getattr(feature, "dtype", None)
    if dtype == "string" or dtype == "large_string":
        if class_names is not None:
            return list(class_names)
        values = {value for ds in datasets for value in column_values(ds, label_column) if value is not None}
        return sorted(values)
    if dtype is not None and ("int" in dtype):
        if class_names is None:
            raise ValueError(f"Label column {label_column!r} holds integers: pass class_names")
        return list(class_names)
    raise ValueError(f"Label column {label_column!r} has unsupported feature {feature}")


# ----------------------------------------------------------------------------------------------------------------
# Canonical conversion
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_progress_bars(n_rows: int | None = None) -> Iterator[None]:
    """Hide `datasets` progress bars for small maps (fewer than a threshold of rows, or always when None)."""
    hide = (n_rows is None or n_rows < _QUIET_BELOW_ROWS) and is_progress_bar_enabled()
    if hide:
        disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            enable_progress_bars()


def _clean_captions(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [item.strip() for item in items if isinstance(item, str) and item.strip()]


def _caption_batch(
    captions: list[Any], indices: list[int], *, origin: np.ndarray | None, prefix: str
) -> dict[str, list[Any]]:
    rows = indices if origin is None else origin[indices].tolist()
    return {
        "texts": [_clean_captions(value) for value in captions],
        "image_id": [f"{prefix}{row}" for row in rows],
        "label": [-1] * len(rows),
    }


def _label_batch(
    labels: list[Any],
    indices: list[int],
    *,
    origin: np.ndarray | None,
    prefix: str,
    texts_per_class: list[list[str]],
    lookup: dict[Any, int] | None,
) -> dict[str, list[Any]]:
    rows = indices if origin is None else origin[indices].tolist()
    ids = [lookup[value] if lookup is not None else int(value) for value in labels]
    return {
        "texts": [texts_per_class[i] for i in ids],
        "image_id": [f"{prefix}{row}" for row in rows],
        "label": ids,
    }


def usable_rows(dataset: Dataset, spec: TextSpec) -> np.ndarray:
    """Rows that yield a text: at least one non-empty caption, or a non-null label."""
    values = column_values(dataset, spec.source_column)
    if spec.text_column is not None:
        keep = [i for i, value in enumerate(values) if _clean_captions(value)]
    else:
        keep = [i for i, value in enumerate(values) if value is not None]
    return np.asarray(keep, dtype=np.int64)


def _label_lookup(dataset: Dataset, label_column: str, class_names: Sequence[str]) -> dict[Any, int] | None:
    """For string label columns, a value -> index map; `None` when the column already holds indices."""
    feature = dataset.features[label_column]
    if isinstance(feature, ClassLabel) or "int" in str(getattr(feature, "dtype", "")):
        return None
    return {name: index for index, name in enumerate(class_names)}


def _check_labels(dataset: Dataset, label_column: str, class_names: Sequence[str], where: str) -> None:
    lookup = _label_lookup(dataset, label_column, class_names)
    values = set(column_values(dataset, label_column)) - {None}
    if lookup is not None:
        unknown = sorted(str(v) for v in values if v not in lookup)
        if unknown:
            raise ValueError(f"{where}: labels {unknown[:10]} in {label_column!r} are not in class_names")
    elif values and (min(values) < 0 or max(values) >= len(class_names)):
        raise ValueError(
            f"{where}: label indices {min(values)}..{max(values)} out of range for {len(class_names)} classes"
        )


def _batch_function(
    ds: Dataset, spec: TextSpec, class_names: Sequence[str] | None, origin: np.ndarray | None, prefix: str
) -> Callable[..., dict[str, list[Any]]]:
    """The batched map function producing `texts`, `image_id`, `label` from the text or label column."""
    if spec.text_column is not None:
        return partial(_caption_batch, origin=origin, prefix=prefix)
    if class_names is None:
        raise ValueError(f"Label column {spec.label_column!r} needs class names")
    texts = [[format_template(t, name) for t in spec.templates] for name in class_names]
    lookup = _label_lookup(ds, spec.source_column, class_names)
    return partial(_label_batch, origin=origin, prefix=prefix, texts_per_class=texts, lookup=lookup)


def _to_canonical(
    dataset: Dataset,
    *,
    source: str,
    split: str,
    spec: TextSpec,
    class_names: Sequence[str] | None,
    indices: Sequence[int] | np.ndarray | None = None,
    id_column: str | None = None,
) -> Dataset:
    id_columns = [id_column] if id_column is not None else []
    check_columns(dataset, [spec.image_column, spec.source_column, *id_columns], source=source, split=split)
    origin = None if indices is None else np.asarray(indices, dtype=np.int64)
    ds = dataset if origin is None else dataset.select(origin)
    if id_column is not None:  # ids "<source>/<split>/<value>": the batch functions index these keys by position
        origin = np.asarray([str(v) for v in column_values(ds, id_column)], dtype=object)
    ds = ds.select_columns([spec.image_column, spec.source_column])
    if spec.label_column is not None and class_names is not None:
        _check_labels(ds, spec.source_column, class_names, f"Dataset {source!r}, split {split!r}")
    function = _batch_function(ds, spec, class_names, origin, f"{source}/{split}/")
    ds = ds.cast_column(spec.image_column, ImageFeature(decode=False))
    if spec.image_column != "image":
        ds = ds.rename_column(spec.image_column, "image")
    with quiet_progress_bars(len(ds)):
        ds = ds.map(
            function,
            batched=True,
            with_indices=True,
            input_columns=[spec.source_column],
            remove_columns=[spec.source_column],
            features=CANONICAL_FEATURES,
            desc=f"Canonical {source}/{split}",
        )
        if spec.text_column is not None and len(usable_rows(ds, TextSpec(text_column="texts"))) < len(ds):
            ds = ds.filter(lambda texts: [len(t) > 0 for t in texts], input_columns=["texts"], batched=True)
    return ds.select_columns(list(CANONICAL_FEATURES))


def to_canonical(
    dataset: Dataset,
    *,
    source: str,
    split: str,
    text_column: str | None = None,
    label_column: str | None = None,
    class_names: Sequence[str] | None = None,
    train_templates: Sequence[str] | None = None,
    image_column: str = "image",
    indices: Sequence[int] | None = None,
) -> Dataset:
    """Convert rows to the canonical schema (`image`, `texts`, `image_id`, `label`) without decoding images.

    `image_id` is `"<source>/<split>/<row>"` with the row index in `dataset` (also when `indices` selects a subset).
    Captioned rows whose caption list is empty are dropped; class labels become text through `train_templates`
    (default `"a photo of a {label}."`) and `label` indexes `class_names` (see `resolve_class_names`).
    """
    spec = TextSpec(
        text_column=text_column,
        label_column=label_column,
        class_names=class_names,  # type: ignore[arg-type]
        train_templates=train_templates,  # type: ignore[arg-type]
        image_column=image_column,
    )
    check_columns(dataset, [image_column, spec.source_column], source=source, split=split)
    names = None if label_column is None else resolve_class_names([dataset], label_column, class_names)
    return _to_canonical(dataset, source=source, split=split, spec=spec, class_names=names, indices=indices)


def remap_labels(dataset: Dataset, mapping: Mapping[int, int]) -> Dataset:
    """Re-index the `label` column of a canonical dataset (e.g. global class -> index within a task)."""
    table = dict(mapping)

    def apply(labels: list[int]) -> dict[str, list[int]]:
        return {"label": [table[label] for label in labels]}

    with quiet_progress_bars(len(dataset)):
        return dataset.map(apply, batched=True, input_columns=["label"], features=CANONICAL_FEATURES)


# ----------------------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------------------


def validate_images(
    dataset: Dataset, where: str, *, image_column: str = "image", batch_size: int = 256
) -> int:
    """Decode every image; raise `CorruptImageError` naming `where` and the row (its `image_id` if present).

    Returns the number of images checked.
    """
    ds = dataset
    if isinstance(ds.features.get(image_column), ImageFeature):
        ds = ds.cast_column(image_column, ImageFeature(decode=False))
    has_ids = "image_id" in ds.column_names
    columns = [image_column] + (["image_id"] if has_ids else [])
    row = 0
    for batch in ds.select_columns(columns).iter(batch_size=batch_size):
        for offset, value in enumerate(batch[image_column]):
            label = f"image {batch['image_id'][offset]}" if has_ids else f"row {row}"
            decode_image(value, f"{where}, {label}")
            row += 1
    return row


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
    wanted = {str(v) for v in _as_group(value)}
    raw = [str(v) for v in column_values(dataset, column)]
    readable = _readable_values(dataset, column)
    keep = [i for i, (a, b) in enumerate(zip(raw, readable, strict=True)) if a in wanted or b in wanted]
    return np.asarray(keep, dtype=np.int64)


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


# ----------------------------------------------------------------------------------------------------------------
# Building tasks
# ----------------------------------------------------------------------------------------------------------------


def _resolve(entry: TaskSource) -> _Resolved:
    """Load both splits of a task source and check its columns and labels (before any task is built)."""
    spec = entry.spec
    eval_data = entry.eval if entry.eval is not None else entry.train
    if entry.eval is None and isinstance(entry.train, Dataset):
        raise ValueError(f"Task {entry.name!r}: give an eval dataset (train is a single Dataset)")
    data = {
        "train": load_split(entry.train, entry.train_split),
        "eval": load_split(eval_data, entry.eval_split),
    }
    splits = {"train": entry.train_split, "eval": entry.eval_split}
    source = entry.source or source_name(entry.train)
    where = dict(entry.where or {})
    for role, ds in data.items():
        check_columns(ds, [spec.image_column, spec.source_column, *where], source=source, split=splits[role])
    names = None
    if spec.label_column is not None:
        names = resolve_class_names(list(data.values()), spec.label_column, spec.class_names)
    return _Resolved(entry.name, spec, data, splits, source, names, where)


def _empty_error(stream: str, item: _Resolved, role: str, reason: str) -> ValueError:
    ds, split = item.data[role], item.splits[role]
    message = f"Stream {stream!r}, task {item.name!r}, split {split!r} of dataset {item.source!r} is empty: {reason}."
    for column in item.where:
        message += f" Values that occur in {column!r}: {_occurring(ds, column)}."
    return ValueError(message)


def _task_rows(stream: str, item: _Resolved, role: str) -> np.ndarray:
    """The rows of one split that make up the task (restriction, `where` filters, usable text), or an error."""
    ds = item.data[role]
    rows = item.rows.get(role, np.arange(len(ds), dtype=np.int64))
    for column, value in item.where.items():
        rows = np.intersect1d(rows, _rows_where(ds, column, value))
        if len(rows) == 0:
            raise _empty_error(stream, item, role, f"no rows where {column} == {group_name(value)!r}")
    rows = np.intersect1d(rows, usable_rows(ds, item.spec))
    if len(rows) == 0:
        raise _empty_error(stream, item, role, f"no row has text in column {item.spec.source_column!r}")
    return rows


def _build_split(stream: str, item: _Resolved, role: str, limits: _Limits) -> Dataset:
    """One split of a task in the canonical schema (rows selected, subsampled, converted, optionally validated)."""
    rows = subsample(_task_rows(stream, item, role), limits.limit(role), limits.seed, stream, item.name, role)
    built = _to_canonical(
        item.data[role],
        source=item.source,
        split=item.splits[role],
        spec=item.spec,
        class_names=item.class_names,
        indices=rows,
        id_column=item.id_column,
    )
    if limits.validate_images:
        validate_images(built, f"stream {stream!r}, task {item.name!r}, split {item.splits[role]!r}")
    return built


def _make_task(item: _Resolved, train: Dataset | IterableDataset, eval: Dataset) -> Task:
    return Task(
        name=item.name,
        train=train,
        eval=eval,
        kind=item.spec.kind,
        class_names=item.class_names,
        eval_templates=list(item.spec.eval_templates or item.spec.templates) if item.class_names else None,
        source=item.source,
    )


def _build_task(stream: str, item: _Resolved, limits: _Limits) -> Task:
    return _make_task(item, _build_split(stream, item, "train", limits), _build_split(stream, item, "eval", limits))


def _build_stream(name: str, items: Sequence[_Resolved], limits: _Limits) -> TaskStream:
    return TaskStream(name=name, tasks=[_build_task(name, item, limits) for item in items])


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
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """One task per entry, in order. An entry is a `TaskSource`, a mapping of its fields (e.g. from YAML), or a
    tuple `(name, train, eval, {text spec...})`. All sources are loaded and checked before any task is built."""
    items = [_resolve(_as_source(entry)) for entry in entries]
    return _build_stream(name, items, _Limits(max_train_per_task, max_eval_per_task, seed, validate_images))


def _base_source(
    train: DatasetSource,
    eval: DatasetSource | None,
    spec_kwargs: dict[str, Any],
    splits: tuple[str, str],
    source: str | None,
) -> _Resolved:
    """Load and check the shared train/eval datasets of a single-source stream once."""
    entry = TaskSource(
        name="",
        train=train,
        eval=eval,
        train_split=splits[0],
        eval_split=splits[1],
        source=source,
        **spec_kwargs,
    )
    return _resolve(entry)


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
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """One task per value of `column`, in the given order (domain, category, year, language...).

    A value may be a list/tuple of values grouped into one task. Values match as strings (so `2011` and `"2011"`
    both select a year), and a `ClassLabel` column matches its names as well as its indices.
    """
    spec = dict(
        text_column=text_column,
        label_column=label_column,
        class_names=class_names,
        train_templates=train_templates,
        eval_templates=eval_templates,
        image_column=image_column,
    )
    base = _base_source(train, eval, spec, (train_split, eval_split), source)
    for role, ds in base.data.items():
        check_columns(ds, [column], source=base.source, split=base.splits[role])
    names = list(task_names) if task_names is not None else [group_name(v) for v in values]
    if len(names) != len(values):
        raise ValueError(f"task_names has {len(names)} names for {len(values)} values")
    items = [
        replace(base, name=task, where={column: value}) for task, value in zip(names, values, strict=True)
    ]
    stream = name or f"{base.source}-by-{column}"
    return _build_stream(stream, items, _Limits(max_train_per_task, max_eval_per_task, seed, validate_images))


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
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    validate_images: bool = False,
) -> TaskStream:
    """A random equal split of train and of eval into `n_tasks` disjoint parts (the Mod-X protocol).

    Rows without text are left out first; part sizes differ by at most one. The split depends only on `seed`.
    """
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be at least 1, got {n_tasks}")
    spec = dict(
        text_column=text_column,
        label_column=label_column,
        class_names=class_names,
        train_templates=train_templates,
        eval_templates=eval_templates,
        image_column=image_column,
    )
    base = _base_source(train, eval, spec, (train_split, eval_split), source)
    names = list(task_names) if task_names is not None else [f"{base.source}-{i}" for i in range(n_tasks)]
    if len(names) != n_tasks:
        raise ValueError(f"task_names has {len(names)} names for {n_tasks} tasks")
    parts = {}
    for role, ds in base.data.items():
        rows = usable_rows(ds, base.spec)
        if len(rows) < n_tasks:
            raise ValueError(
                f"Dataset {base.source!r}, split {base.splits[role]!r} has {len(rows)} usable rows, "
                f"fewer than n_tasks={n_tasks}"
            )
        parts[role] = [rows[part] for part in _equal_parts(len(rows), n_tasks, seed, role)]
    items = [
        replace(base, name=task, rows={role: parts[role][i] for role in parts})
        for i, task in enumerate(names)
    ]
    stream = name or f"{base.source}-random{n_tasks}"
    return _build_stream(stream, items, _Limits(max_train_per_task, max_eval_per_task, seed, validate_images))


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
    max_train_per_task: int | None = None,
    max_eval_per_task: int | None = None,
    seed: int = 0,
    validate_images: bool = False,
) -> TaskStream:
    """Class-incremental stream: one classification task per group of classes (indices or names).

    `label_space="task"`: each task's `class_names` are its own classes and labels index them (zero-shot among the
    task's classes). `label_space="all"`: every task keeps all class names and global labels.
    """
    if label_space not in ("task", "all"):
        raise ValueError(f"label_space must be 'task' or 'all', got {label_space!r}")
    spec = dict(
        label_column=label_column,
        class_names=class_names,
        train_templates=train_templates,
        eval_templates=eval_templates,
        image_column=image_column,
    )
    base = _base_source(train, eval, spec, (train_split, eval_split), source)
    all_names = base.class_names or []
    groups = [[_class_index(c, all_names) for c in group] for group in class_groups]
    default_names = ["+".join(all_names[i] for i in group) for group in groups]
    names = list(task_names) if task_names is not None else default_names
    if len(names) != len(groups):
        raise ValueError(f"task_names has {len(names)} names for {len(groups)} class groups")
    items = [
        replace(base, name=task, where={label_column: group})
        for task, group in zip(names, groups, strict=True)
    ]
    stream_name = name or f"{base.source}-classes{len(groups)}"
    stream = _build_stream(
        stream_name, items, _Limits(max_train_per_task, max_eval_per_task, seed, validate_images)
    )
    if label_space == "task":
        for task, group in zip(stream.tasks, groups, strict=True):
            _localise_labels(task, group, all_names)
    return stream


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


def _step_rows(dataset: Dataset, time_column: str, steps: TimeSteps) -> tuple[list[np.ndarray], np.ndarray]:
    """Rows of each step, and the step index of every row (-1: in no step)."""
    assigned = steps.assign(column_values(dataset, time_column))
    return [np.flatnonzero(assigned == i) for i in range(len(steps))], assigned


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


def _content_key(image: Any) -> str:
    """A stable key for an image cell (hash of its bytes, else of its path): streamed rows have no row number."""
    if isinstance(image, dict):
        data = image.get("bytes") or str(image.get("path")).encode("utf-8")
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:  # a decoded PIL image
        data = image.tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _streamed_batch(
    batch: dict[str, list[Any]],
    *,
    spec: TextSpec,
    id_column: str | None,
    prefix: str,
    texts_per_class: list[list[str]] | None,
    lookup: dict[Any, int] | None,
) -> dict[str, list[Any]]:
    """Canonical `texts`, `image_id`, `label` of a batch of streamed rows (ids from `id_column`, else content)."""
    values = batch[spec.source_column]
    keys = batch[id_column] if id_column is not None else [_content_key(v) for v in batch[spec.image_column]]
    origin, positions = np.asarray([str(k) for k in keys], dtype=object), list(range(len(values)))
    if texts_per_class is None:
        return _caption_batch(values, positions, origin=origin, prefix=prefix)
    return _label_batch(values, positions, origin=origin, prefix=prefix, texts_per_class=texts_per_class,
                        lookup=lookup)


def _in_step(times: list[Any], *, steps: TimeSteps, step: int) -> list[bool]:
    return (steps.assign(times) == step).tolist()


def _has_texts(texts: list[list[str]]) -> list[bool]:
    return [len(t) > 0 for t in texts]


def _canonical_step_stream(
    rows: IterableDataset,
    item: _Resolved,
    *,
    time_column: str,
    steps: TimeSteps,
    step: int,
    limit: int | None,
    shuffle_buffer: int | None,
    seed: int,
) -> IterableDataset:
    """The rows of one time step of a streamed split, converted to the canonical schema as they are read."""
    spec, split = item.spec, item.splits["train"]
    ids = [item.id_column] if item.id_column is not None else []
    ds = rows.select_columns(list(dict.fromkeys([spec.image_column, spec.source_column, time_column, *ids])))
    if ds.features is not None:  # before any filter or map: rows are then never decoded while streaming
        ds = ds.cast_column(spec.image_column, ImageFeature(decode=False))
    if spec.image_column != "image":
        ds = ds.rename_column(spec.image_column, "image")
    ds = ds.filter(partial(_in_step, steps=steps, step=step), input_columns=[time_column], batched=True)
    texts_per_class, lookup = None, None
    if spec.label_column is not None:
        texts_per_class = [[format_template(t, name) for t in spec.templates] for name in item.class_names or []]
        lookup = _label_lookup(item.data["eval"], spec.label_column, item.class_names or [])
    function = partial(_streamed_batch, spec=replace(spec, image_column="image"), id_column=item.id_column,
                       prefix=f"{item.source}/{split}/", texts_per_class=texts_per_class, lookup=lookup)
    used = list(dict.fromkeys([spec.source_column, time_column, *ids]))
    ds = ds.map(function, batched=True, remove_columns=used, features=CANONICAL_FEATURES)
    ds = ds.filter(_has_texts, input_columns=["texts"], batched=True)
    if limit is not None:
        ds = ds.take(limit)
    return shuffled(ds, seed=seed, buffer_size=shuffle_buffer)


@dataclass
class _Columns:
    """Just enough of a dataset for `check_columns` (a stream's column names)."""

    column_names: list[str]


def _streamed_time_stream(
    name: str,
    train: str | os.PathLike,
    base: _Resolved,
    *,
    time_column: str,
    steps: TimeSteps,
    task_names: Sequence[str],
    eval_rows: list[np.ndarray],
    shuffle_buffer: int | None,
    limits: _Limits,
) -> TaskStream:
    """Tasks that stream their train split from a local folder or the Hub (`load_dataset(streaming=True)`), one
    filter on the time column per step; eval splits are map-style."""
    rows = load_dataset(os.fspath(train), split=base.splits["train"], streaming=True)
    check_columns(_Columns(column_names(rows)), [base.spec.image_column, base.spec.source_column, time_column,
                  *([base.id_column] if base.id_column else [])], source=base.source, split=base.splits["train"])
    tasks = []
    for index, task_name in enumerate(task_names):
        item = replace(base, name=task_name, rows={"eval": eval_rows[index]})
        train_stream = _canonical_step_stream(
            rows, item, time_column=time_column, steps=steps, step=index, limit=limits.max_train_per_task,
            shuffle_buffer=shuffle_buffer, seed=limits.seed + index,
        )
        tasks.append(_make_task(item, train_stream, _build_split(name, item, "eval", limits)))
    return TaskStream(name=name, tasks=tasks)


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
    a timestamp are dropped**: the stream ends at its last step, as TiC-CLIP leaves out years after its last one.
    The time column holds numbers (years) or dates (Arrow timestamps/dates, or ISO-8601 strings); on dates a
    boundary names a whole period (`2011` or `"2011"`: up to the end of 2011); see `hf_ccl.data.timesteps`.
    Default task names: `"2011"`, `"2013-2015"` for year steps (the first step named by its last year).
    A step without rows in either split is an error that lists the rows per step.

    `id_column`: image ids `"<source>/<split>/<value>"` from this column (unique per split) instead of row numbers.

    `streaming=True`: each task's `train` is a streaming `datasets.IterableDataset` shuffled with a buffer of
    `shuffle_buffer` rows (seed `seed + k` for task k; None: stream order); `eval` stays map-style.
    - A `Dataset`/`DatasetDict` source is built as usual, then read as `num_shards` shards
      (`Dataset.to_iterable_dataset`): the same rows and image ids as without streaming.
    - A local folder or Hub id is read with `load_dataset(..., streaming=True)`, filtered on the time column once
      per step (each step reads the whole source). Without `id_column`, image ids are a hash of the image bytes
      (streamed rows have no row number). Train steps are not counted in advance (an empty one fails when the run
      starts), `max_train_per_task` keeps the first rows of the step, `validate_images` checks eval splits only,
      and a string label column needs `class_names`.
    """
    spec = dict(
        text_column=text_column,
        label_column=label_column,
        class_names=class_names,
        train_templates=train_templates,
        eval_templates=eval_templates,
        image_column=image_column,
    )
    streamed = streaming and isinstance(train, (str, os.PathLike))
    limits = _Limits(max_train_per_task, max_eval_per_task, seed, validate_images)
    if streamed:
        base = _streamed_base(train, eval, spec, (train_split, eval_split), source, class_names)
    else:
        base = _base_source(train, eval, spec, (train_split, eval_split), source)
    base = replace(base, id_column=id_column)
    for role, ds in base.data.items():
        check_columns(ds, [time_column, *([id_column] if id_column else [])], source=base.source,
                      split=base.splits[role])
        if id_column is not None:
            _check_unique_ids(ds, id_column, base.source, base.splits[role])
    steps = TimeSteps.parse(boundaries, column_kind(base.data["eval"].features, time_column))
    names = list(task_names) if task_names is not None else steps.names()
    if len(names) != len(steps):
        raise ValueError(f"task_names has {len(names)} names for {len(steps)} time steps")
    stream_name = name or f"{base.source}-by-{time_column}"
    rows, counts = {}, {}
    for role, ds in base.data.items():
        rows[role], counts[base.splits[role]] = _step_rows(ds, time_column, steps)
    for role, per_step in rows.items():
        for step_name, step_rows in zip(names, per_step, strict=True):
            if len(step_rows) == 0:
                raise _empty_step_error(stream_name, base.source, names, (step_name, base.splits[role]), counts)
    if streamed:
        return _streamed_time_stream(
            stream_name, train, base, time_column=time_column, steps=steps, task_names=names,
            eval_rows=rows["eval"], shuffle_buffer=shuffle_buffer, limits=limits,
        )
    items = [
        replace(base, name=task, rows={role: rows[role][i] for role in rows}) for i, task in enumerate(names)
    ]
    stream = _build_stream(stream_name, items, limits)
    if streaming:
        stream = to_streaming(stream, num_shards=num_shards, shuffle_buffer=shuffle_buffer, seed=seed)
    return stream


def _streamed_base(
    train: str | os.PathLike,
    eval: DatasetSource | None,
    spec_kwargs: dict[str, Any],
    splits: tuple[str, str],
    source: str | None,
    class_names: Sequence[str] | None,
) -> _Resolved:
    """Like `_base_source`, but only the eval split is loaded (map-style); the train split is streamed later."""
    text_spec = TaskSource(name="", train=train, **spec_kwargs).spec
    eval_data = load_split(eval if eval is not None else train, splits[1])
    label = source or source_name(train)
    check_columns(eval_data, [text_spec.image_column, text_spec.source_column], source=label, split=splits[1])
    names = None
    if text_spec.label_column is not None:
        feature = eval_data.features[text_spec.label_column]
        if class_names is None and not isinstance(feature, ClassLabel):
            raise ValueError(
                f"Streaming {label!r}: pass class_names for label column {text_spec.label_column!r} (the classes "
                "cannot be read from a stream in advance)"
            )
        names = resolve_class_names([eval_data], text_spec.label_column, class_names)
    return _Resolved("", text_spec, {"eval": eval_data}, {"train": splits[0], "eval": splits[1]}, label, names)
