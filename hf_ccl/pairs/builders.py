"""Modality-pair streams for the older pair learner (`PairStreamLearner`): the one loop's `flickr-fashion-pairs`
(`hf_ccl.data.pair_streams`), as `PairStream`s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..data import pair_streams
from ..data.pair_streams import DEFAULT_PAIRS, flickr_reserved_rows
from .task import PairStream, PairTask

__all__ = ["DEFAULT_PAIRS", "flickr_fashion_pairs", "flickr_reserved_rows"]


def flickr_fashion_pairs(
    data_root: str | Path,
    pairs: Sequence[tuple[str, str, str]] = DEFAULT_PAIRS,
    *,
    train_per_task: int = 500,
    test_per_task: int = 500,
    reserve_train_images: int = 0,
    reserve_seed: int = 0,
    seed: int = 0,
) -> PairStream:
    """`hf_ccl.data.pair_streams.flickr_fashion_pairs` as a `PairStream` (same tasks, rows and names)."""
    stream = pair_streams.flickr_fashion_pairs(
        data_root, pairs, train_per_task=train_per_task, test_per_task=test_per_task,
        reserve_train_images=reserve_train_images, reserve_seed=reserve_seed, seed=seed,
    )
    return PairStream([PairTask(task.name, *task.modalities, train=task.train, test=task.eval,
                                metadata={"dataset": task.source}) for task in stream], name=stream.name)
