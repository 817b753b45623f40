"""The canonical schema of a task split (`hf_ccl.data.task`): converting any dataset's rows to it.

Text comes either from a caption column (a string or a list of strings per row: a retrieval task) or from a class
label put through prompt templates (a classification task, scored zero-shot over `class_names` with the
`eval_templates` ensemble). Images are never decoded here: a string column of paths or a `datasets.Image` column is
cast to `Image(decode=False)`, with path-only cells made absolute and checked (`hf_ccl.data.images.resolve_image`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
from datasets import ClassLabel, Dataset, Features, IterableDataset, List, Value
from datasets import Image as ImageFeature
from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

from .images import PathBase, check_image_feature, decode_image, resolve_image
from .templates import format_template

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
    def kind(self) -> str:
        return "retrieval" if self.text_column is not None else "classification"

    @property
    def source_column(self) -> str:
        return self.text_column if self.text_column is not None else str(self.label_column)

    @property
    def templates(self) -> tuple[str, ...]:
        return self.train_templates or DEFAULT_TRAIN_TEMPLATES



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


def clean_captions(value: Any) -> list[str]:
    """The non-empty, stripped captions of a caption cell (a string, a list of strings, or None)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [item.strip() for item in items if isinstance(item, str) and item.strip()]


def caption_batch(
    captions: list[Any], indices: list[int], *, origin: np.ndarray | None, prefix: str
) -> dict[str, list[Any]]:
    """Canonical `texts`, `image_id` (`prefix` + row, or + `origin[index]`) and `label` (-1) of captioned rows."""
    rows = indices if origin is None else origin[indices].tolist()
    return {
        "texts": [clean_captions(value) for value in captions],
        "image_id": [f"{prefix}{row}" for row in rows],
        "label": [-1] * len(rows),
    }


def label_batch(
    labels: list[Any],
    indices: list[int],
    *,
    origin: np.ndarray | None,
    prefix: str,
    texts_per_class: list[list[str]],
    lookup: dict[Any, int] | None,
) -> dict[str, list[Any]]:
    """Canonical `texts` (the class's templated prompts), `image_id` and `label` of class-labelled rows."""
    rows = indices if origin is None else origin[indices].tolist()
    ids = [lookup[value] if lookup is not None else int(value) for value in labels]
    return {
        "texts": [texts_per_class[i] for i in ids],
        "image_id": [f"{prefix}{row}" for row in rows],
        "label": ids,
    }


def has_text(values: list[Any], *, captions: bool) -> list[bool]:
    """Whether each value of a text column yields a text: a non-empty caption (`captions`), else a non-null label."""
    if captions:
        return [bool(clean_captions(value)) for value in values]
    return [value is not None for value in values]


def usable_rows(dataset: Dataset, spec: TextSpec) -> np.ndarray:
    """Rows that yield a text: at least one non-empty caption, or a non-null label."""
    keep = has_text(column_values(dataset, spec.source_column), captions=spec.text_column is not None)
    return np.flatnonzero(np.asarray(keep, dtype=bool)).astype(np.int64)


def label_lookup(dataset: Dataset, label_column: str, class_names: Sequence[str]) -> dict[Any, int] | None:
    """For string label columns, a value -> index map; `None` when the column already holds indices."""
    feature = dataset.features[label_column]
    if isinstance(feature, ClassLabel) or "int" in str(getattr(feature, "dtype", "")):
        return None
    return {name: index for index, name in enumerate(class_names)}


def _check_labels(dataset: Dataset, label_column: str, class_names: Sequence[str], where: str) -> None:
    lookup = label_lookup(dataset, label_column, class_names)
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
        return partial(caption_batch, origin=origin, prefix=prefix)
    if class_names is None:
        raise ValueError(f"Label column {spec.label_column!r} needs class names")
    texts = [[format_template(t, name) for t in spec.templates] for name in class_names]
    lookup = label_lookup(ds, spec.source_column, class_names)
    return partial(label_batch, origin=origin, prefix=prefix, texts_per_class=texts, lookup=lookup)


def canonical_split(
    dataset: Dataset,
    *,
    source: str,
    split: str,
    spec: TextSpec,
    class_names: Sequence[str] | None,
    indices: Sequence[int] | np.ndarray | None = None,
    id_column: str | None = None,
    base: PathBase | None = None,
) -> Dataset:
    """The rows `indices` (default: all) of `dataset` in the canonical schema; image paths resolve against `base`
    (default: the working directory), and a missing image is an error naming its row."""
    id_columns = [id_column] if id_column is not None else []
    check_columns(dataset, [spec.image_column, spec.source_column, *id_columns], source=source, split=split)
    origin = None if indices is None else np.asarray(indices, dtype=np.int64)
    rows = origin
    ds = dataset if origin is None else dataset.select(origin)
    if id_column is not None:  # ids "<source>/<split>/<value>": the batch functions index these keys by position
        origin = np.asarray([str(v) for v in column_values(ds, id_column)], dtype=object)
    ds = ds.select_columns([spec.image_column, spec.source_column])
    if spec.label_column is not None and class_names is not None:
        _check_labels(ds, spec.source_column, class_names, f"Dataset {source!r}, split {split!r}")
    function = _batch_function(ds, spec, class_names, origin, f"{source}/{split}/")
    base = base or PathBase(Path.cwd(), f"dataset {source!r}, split {split!r}")
    check_image_feature(ds.features[spec.image_column], spec.image_column, base.origin)
    ds = ds.cast_column(spec.image_column, ImageFeature(decode=False))
    ds = resolve_image_column(ds, spec.image_column, base, rows)
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
    base: PathBase | None = None,
) -> Dataset:
    """Convert rows to the canonical schema (`image`, `texts`, `image_id`, `label`) without decoding images.

    Image paths (a string column, or path-only `Image` cells) resolve against `base.folder` (default: the working
    directory); an empty cell or a path to no file is a `MissingImageError` naming the row.

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
    return canonical_split(dataset, source=source, split=split, spec=spec, class_names=names, indices=indices,
                           base=base)


def _remap(labels: list[int], *, table: dict[int, int]) -> dict[str, list[int]]:
    return {"label": [table[label] for label in labels]}


def remap_labels(dataset: Dataset | IterableDataset, mapping: Mapping[int, int]) -> Dataset | IterableDataset:
    """Re-index the `label` column of a canonical dataset or stream (e.g. global class -> index within a task)."""
    function = partial(_remap, table=dict(mapping))
    if isinstance(dataset, IterableDataset):
        return dataset.map(function, batched=True, input_columns=["label"], features=CANONICAL_FEATURES)
    with quiet_progress_bars(len(dataset)):
        return dataset.map(function, batched=True, input_columns=["label"], features=CANONICAL_FEATURES)


# ----------------------------------------------------------------------------------------------------------------
# Images
# ----------------------------------------------------------------------------------------------------------------


def _resolve_batch(
    images: list[Any], indices: list[int], *, column: str, base: PathBase, rows: np.ndarray | None
) -> dict[str, list[Any]]:
    where = [f"{base.origin}, row {i if rows is None else int(rows[i])}, column {column!r}" for i in indices]
    return {column: [resolve_image(image, base, place) for image, place in zip(images, where, strict=True)]}


def resolve_image_column(
    dataset: Dataset, column: str, base: PathBase, rows: np.ndarray | None = None
) -> Dataset:
    """`dataset` with the path-only cells of its `Image(decode=False)` column made absolute against `base` and
    checked (`hf_ccl.data.images.resolve_image`); `rows` are the source rows of `dataset`'s rows, for errors.
    A column whose cells all hold bytes is returned as it is: only the Arrow validity bitmaps are read."""
    cells = dataset.data.column(column)  # the whole table (a `select` is an indices mapping): a superset, no copy
    if cells.null_count == 0 and pc.struct_field(cells, "bytes").null_count == 0:
        return dataset
    function = partial(_resolve_batch, column=column, base=base, rows=rows)
    with quiet_progress_bars(len(dataset)):
        return dataset.map(function, batched=True, with_indices=True, input_columns=[column],
                           features=dataset.features, desc=f"Image paths of {base.origin}")


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

