"""Cached frozen-encoder features of a pair task (spec cmcl.md §2.1: the paper pre-extracts and caches them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset as TorchDataset

from .encoders import ModalityEncoder
from .task import PairTask


@dataclass
class TaskFeatures:
    """z* of both sides of a task's train and test pairs: row i of `*_a` and `*_b` is pair i (float32, CPU)."""

    train_a: torch.Tensor
    train_b: torch.Tensor
    test_a: torch.Tensor
    test_b: torch.Tensor


def encode_task(task: PairTask, encoders: Mapping[str, ModalityEncoder]) -> TaskFeatures:
    """Encode both splits of `task` with each modality's frozen encoder."""
    encoded = {}
    for split_name in ("train", "test"):
        split = getattr(task, split_name)
        for side, modality in (("a", task.modality_a), ("b", task.modality_b)):
            if modality not in encoders:
                raise ValueError(f"task {task.name!r}: no encoder for modality {modality!r}")
            try:
                features = encoders[modality].encode(split[task.column(modality)])
            except ValueError as error:
                raise ValueError(f"task {task.name!r} {split_name}/{modality}: {error}") from error
            if features.shape[0] != len(split):
                raise ValueError(
                    f"task {task.name!r} {split_name}/{modality}: encoder returned {features.shape[0]} rows "
                    f"for {len(split)}"
                )
            encoded[f"{split_name}_{side}"] = features
    return TaskFeatures(**encoded)


class FeaturePairs(TorchDataset):
    """A torch dataset of aligned feature rows, {"a": xa[i], "b": xb[i]}, for the Trainer's default collator."""

    def __init__(self, features_a: torch.Tensor, features_b: torch.Tensor):
        if features_a.shape[0] != features_b.shape[0]:
            raise ValueError(f"{features_a.shape[0]} a-rows but {features_b.shape[0]} b-rows")
        self.features_a, self.features_b = features_a, features_b

    def __len__(self) -> int:
        return self.features_a.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"a": self.features_a[index], "b": self.features_b[index]}
