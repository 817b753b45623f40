"""Modality-pair tasks and streams (CMCL's setting, spec cmcl.md §1.2): each task aligns two named modalities.

A modality is a *learner head* name, not a tower (spec §1.4): `en`, `de` and `title` may all be read by the CLIP
text tower and still have their own heads. Each modality's raw values are read from one dataset column and
encoded by that modality's frozen encoder (`hf_ccl.pairs.encoders`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from datasets import Dataset


@dataclass
class PairTask:
    """One step of a modality-pair stream: align `modality_a` (the loss's anchor, Eq. 2) with `modality_b`.

    `train` and `test` hold one row per pair; `column_a` / `column_b` name the columns with each side's raw value
    (an image cell, a caption, a feature vector), defaulting to the modality names."""

    name: str
    modality_a: str
    modality_b: str
    train: Dataset
    test: Dataset
    column_a: str = ""
    column_b: str = ""
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.column_a = self.column_a or self.modality_a
        self.column_b = self.column_b or self.modality_b
        if self.modality_a == self.modality_b:
            raise ValueError(f"task {self.name!r} pairs modality {self.modality_a!r} with itself")
        for split_name, split in (("train", self.train), ("test", self.test)):
            if len(split) == 0:
                raise ValueError(f"task {self.name!r} has an empty {split_name} split")
            missing = [c for c in (self.column_a, self.column_b) if c not in split.column_names]
            if missing:
                raise ValueError(
                    f"task {self.name!r} {split_name} split lacks column(s) {missing}; columns: {split.column_names}"
                )

    @property
    def modalities(self) -> tuple[str, str]:
        return self.modality_a, self.modality_b

    def column(self, modality: str) -> str:
        return self.column_a if modality == self.modality_a else self.column_b


@dataclass
class PairStream:
    """An ordered list of modality-pair tasks with unique names."""

    tasks: list[PairTask]
    name: str = "pairs"

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("a pair stream needs at least one task")
        names = [task.name for task in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be unique, got {names}")

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    def __getitem__(self, index: int) -> PairTask:
        return self.tasks[index]

    @property
    def task_names(self) -> list[str]:
        return [task.name for task in self.tasks]

    @property
    def modalities(self) -> list[str]:
        """Every modality of the stream, in order of first appearance."""
        seen: list[str] = []
        for task in self.tasks:
            for modality in task.modalities:
                if modality not in seen:
                    seen.append(modality)
        return seen

    def check_encoders(self, encoders: Sequence[str]) -> None:
        """Every modality needs an encoder; the error lists the missing ones."""
        missing = [m for m in self.modalities if m not in set(encoders)]
        if missing:
            raise ValueError(f"no encoder for modality(ies) {missing}; encoders given for {sorted(encoders)}")
