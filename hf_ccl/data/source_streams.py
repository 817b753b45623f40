"""A task's train split streamed from its source (`load_dataset(..., streaming=True)`), converted as it is read.

The rows of the task are kept by filters that look at one row at a time (a column value, a time step, a usable
caption or label), so the source is never read whole and never held: what a task selects is what the map-style
build selects. Streamed rows have no row number, so image ids come from an `id_column` or, without one, from a
hash of the image (its bytes, or its resolved path). A limit keeps the first rows of the task's stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from datasets import ClassLabel, IterableDataset
from datasets import Image as ImageFeature

from .canonical import CANONICAL_FEATURES, TextSpec, caption_batch, has_text, label_batch
from .images import PathBase, check_image_feature, resolve_image
from .streaming import shuffled
from .templates import format_template
from .timesteps import TimeSteps


@dataclass(frozen=True)
class RowFilter:
    """Keep the rows for which `keep(values)` (a batch of `column`'s values) is True."""

    column: str
    keep: Callable[[list[Any]], list[bool]]


def _in(values: list[Any], *, wanted: frozenset[str]) -> list[bool]:
    return [str(value) in wanted for value in values]


def _in_step(times: list[Any], *, steps: TimeSteps, step: int) -> list[bool]:
    return (steps.assign(times) == step).tolist()


def matching_strings(feature: Any, value: Any) -> frozenset[str]:
    """The raw values of a column (as strings) that match `value` or a group of values: compared as strings, and
    on a `ClassLabel` column by name as well as by index."""
    wanted = {str(v) for v in (value if isinstance(value, (list, tuple, set, frozenset)) else [value])}
    if isinstance(feature, ClassLabel):
        wanted |= {str(index) for index, name in enumerate(feature.names) if name in wanted}
    return frozenset(wanted)


def where_filter(column: str, feature: Any, value: Any) -> RowFilter:
    """Rows whose `column` matches `value` (see `matching_strings`)."""
    return RowFilter(column, partial(_in, wanted=matching_strings(feature, value)))


def step_filter(column: str, steps: TimeSteps, step: int) -> RowFilter:
    """Rows whose time `column` falls in time step `step`."""
    return RowFilter(column, partial(_in_step, steps=steps, step=step))


def content_key(image: Any) -> str:
    """A stable key for an image cell (hash of its bytes, else of its path): streamed rows have no row number."""
    if isinstance(image, dict):
        data = image.get("bytes") or str(image.get("path")).encode("utf-8")
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:  # a decoded PIL image
        data = image.tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _check_labels(values: list[Any], lookup: dict[Any, int] | None, n_classes: int, where: str) -> None:
    if lookup is not None:
        unknown = sorted({str(value) for value in values if value not in lookup})
        if unknown:
            raise ValueError(f"{where}: labels {unknown[:10]} are not in class_names ({', '.join(map(str, lookup))})")
    elif any(not 0 <= int(value) < n_classes for value in values):
        bad = sorted({int(value) for value in values if not 0 <= int(value) < n_classes})
        raise ValueError(f"{where}: label indices {bad[:10]} out of range for {n_classes} classes")


def _canonical_batch(
    batch: dict[str, list[Any]],
    *,
    spec: TextSpec,
    id_column: str | None,
    prefix: str,
    texts_per_class: list[list[str]] | None,
    lookup: dict[Any, int] | None,
    base: PathBase,
) -> dict[str, list[Any]]:
    """Canonical `image` (paths resolved), `texts`, `image_id`, `label` of a batch of streamed rows."""
    images = [
        resolve_image(image, base, f"{base.origin}, streamed row with {spec.source_column} {value!r}")
        for image, value in zip(batch["image"], batch[spec.source_column], strict=True)
    ]
    keys = batch[id_column] if id_column is not None else [content_key(image) for image in images]
    origin, positions = np.asarray([str(k) for k in keys], dtype=object), list(range(len(images)))
    values = batch[spec.source_column]
    if texts_per_class is not None:
        _check_labels(values, lookup, len(texts_per_class), f"{base.origin}, column {spec.source_column!r}")
    if texts_per_class is None:
        out = caption_batch(values, positions, origin=origin, prefix=prefix)
    else:
        out = label_batch(values, positions, origin=origin, prefix=prefix, texts_per_class=texts_per_class,
                          lookup=lookup)
    return {"image": images, **out}


def canonical_stream(
    rows: IterableDataset,
    *,
    spec: TextSpec,
    filters: Sequence[RowFilter],
    prefix: str,
    base: PathBase,
    class_names: Sequence[str] | None = None,
    lookup: dict[Any, int] | None = None,
    id_column: str | None = None,
    limit: int | None = None,
    shuffle_buffer: int | None = None,
    seed: int = 0,
) -> IterableDataset:
    """The rows of `rows` that pass every filter and have a text, in the canonical schema, as they are read.

    `prefix` starts every image id (`"<source>/<split>/"`); `base` resolves relative image paths; `lookup` maps
    string labels to class indices (None: the column holds indices); `limit` keeps the first rows; the result is
    shuffled with a buffer of `shuffle_buffer` rows (None or 0: source order).
    """
    columns = [spec.image_column, spec.source_column, *(f.column for f in filters)]
    columns += [id_column] if id_column is not None else []
    ds = rows.select_columns(list(dict.fromkeys(columns)))
    if ds.features is not None and spec.image_column in ds.features:  # rows are then never decoded while read
        check_image_feature(ds.features[spec.image_column], spec.image_column, base.origin)
        ds = ds.cast_column(spec.image_column, ImageFeature(decode=False))
    if spec.image_column != "image":
        ds = ds.rename_column(spec.image_column, "image")
    for row_filter in filters:
        ds = ds.filter(row_filter.keep, input_columns=[row_filter.column], batched=True)
    ds = ds.filter(partial(has_text, captions=spec.text_column is not None), input_columns=[spec.source_column],
                   batched=True)
    texts_per_class = None
    if spec.label_column is not None:
        texts_per_class = [[format_template(t, name) for t in spec.templates] for name in class_names or []]
    function = partial(_canonical_batch, spec=spec, id_column=id_column, prefix=prefix,
                       texts_per_class=texts_per_class, lookup=lookup, base=base)
    used = [column for column in dict.fromkeys(columns) if column != spec.image_column]
    ds = ds.map(function, batched=True, remove_columns=used, features=CANONICAL_FEATURES)
    if limit is not None:
        ds = ds.take(limit)
    return shuffled(ds, seed=seed, buffer_size=shuffle_buffer)
