"""Tasks whose training data is a streaming `datasets.IterableDataset` (read as it is consumed, never held whole).

Only a task's `train` may stream; `eval` stays a map-style `Dataset` (a small held-out set that every evaluation
reads in full). A streaming task has no length: the loop trains it for a fixed number of optimizer steps, so a run
with streaming tasks needs a compute budget (`ContinualArguments.samples_per_task` or `training.max_steps`), and the
Trainer reads the stream again (reshuffled, `set_epoch`) when it ends before the budget is spent.

The helpers here look at a dataset of either kind without materialising a stream: `peek` reads its first row only.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from datasets import Dataset, IterableDataset

from .task import TaskStream

#: Rows held by the shuffle buffer of a streaming train split (`IterableDataset.shuffle(buffer_size=...)`).
DEFAULT_SHUFFLE_BUFFER = 1000


def is_streaming(dataset: Any) -> bool:
    """Whether `dataset` is a streaming `datasets.IterableDataset` (no length, no random access)."""
    return isinstance(dataset, IterableDataset)


def peek(dataset: Dataset | IterableDataset) -> dict[str, Any] | None:
    """The first row of a dataset of either kind, or None when it is empty (a stream is read up to one row)."""
    if not is_streaming(dataset):
        return dataset[0] if len(dataset) else None
    return next(iter(dataset), None)


def is_empty(dataset: Dataset | IterableDataset) -> bool:
    """True when the dataset has no row (for a stream: when reading it yields nothing)."""
    return len(dataset) == 0 if not is_streaming(dataset) else peek(dataset) is None


def column_names(dataset: Dataset | IterableDataset) -> list[str]:
    """The columns of a dataset of either kind: known features when the stream has them, else its first row's keys
    (an empty stream with unknown features has none)."""
    names = dataset.column_names
    if names is not None:
        return list(names)
    row = peek(dataset)
    return list(row) if row is not None else []


def shuffled(dataset: IterableDataset, *, seed: int, buffer_size: int | None) -> IterableDataset:
    """`dataset.shuffle(seed, buffer_size)` (shard order and a row buffer); None or 0: unchanged.

    The buffer is fed from one shard at a time: with datasets >= 4 feeding it from several Parquet shards at once
    makes every pass over the stream, and every abandoned iterator (a peek), end with a 5-second sleep.
    """
    if not buffer_size:
        return dataset
    options: dict[str, Any] = {}
    if "max_buffer_input_shards" in inspect.signature(IterableDataset.shuffle).parameters:
        options["max_buffer_input_shards"] = 1
    return dataset.shuffle(seed=seed, buffer_size=buffer_size, **options)


def whole_batches(dataset: IterableDataset, batch_size: int) -> IterableDataset:
    """The stream without the last `len % batch_size` rows of each pass, so that every batch is full.

    `Trainer` passes `dataloader_drop_last` to its DataLoader only for map-style datasets: a stream's last, short
    batch of each pass would otherwise be a (smaller) optimizer step of its own.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return dataset.map(None, batched=True, batch_size=batch_size, drop_last_batch=True, features=dataset.features)


def streaming_split(
    dataset: Dataset, *, num_shards: int = 1, shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER, seed: int = 0
) -> IterableDataset:
    """A map-style split as a stream of `num_shards` contiguous shards (at most one per row), shuffled by shard
    order and a buffer of `shuffle_buffer` rows (None or 0: read in row order). The Trainer reshuffles every pass
    (`set_epoch`)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    stream = dataset.to_iterable_dataset(num_shards=max(1, min(num_shards, len(dataset))))
    return shuffled(stream, seed=seed, buffer_size=shuffle_buffer)


def to_streaming(
    stream: TaskStream,
    *,
    num_shards: int = 1,
    shuffle_buffer: int | None = DEFAULT_SHUFFLE_BUFFER,
    seed: int = 0,
) -> TaskStream:
    """A copy of `stream` whose tasks train on streaming `IterableDataset`s (`Dataset.to_iterable_dataset`), read
    lazily from the splits' Arrow files; eval splits stay map-style and the drop report is kept. Task k's stream is
    shuffled with `seed + k`. Tasks already streaming are kept as they are."""
    tasks = []
    for index, task in enumerate(stream):
        train = task.train
        if not is_streaming(train):
            train = streaming_split(train, num_shards=num_shards, shuffle_buffer=shuffle_buffer, seed=seed + index)
        tasks.append(dataclasses.replace(task, train=train))
    return dataclasses.replace(stream, tasks=tasks)
