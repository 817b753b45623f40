"""A reservoir replay buffer that keeps references into a stream's train splits, never tensors (DESIGN.md,
"Data and scale").

Reservoir sampling is Vitter's Algorithm R (Vitter 1985, "Random sampling with a reservoir", ACM TOMS 11(1)),
the buffer of ER (Chaudhry et al. 2019) and DER (Buzzega et al. 2020) as used by CTP (specs/ctp.md App. B.2: "each
sample has an equal probability of being kept", updated once after each task) and CLL-CLIP (specs/cllclip.md §6):

    for the i-th example seen (i = 1, 2, ...):  i <= K: slot i-1 <- example
                                                i >  K: j ~ U{0, ..., i-1};  j < K: slot j <- example

so after n examples every one of them is in the buffer with probability K/n. One slot holds one training example
(a row of a task's canonical train split: one image and its captions; on a pair task, one pair of cached features),
so the budget K counts image-text pairs (modality pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from datasets import Dataset, Features, Value, concatenate_datasets

from .builders import quiet_progress_bars
from .task import TaskStream


class ReservoirBuffer:
    """Reservoir sample (Algorithm R) of every example seen, stored as `(task index, row index)` per slot.

    Deterministic: the draws of one `add_task` call come from a NumPy generator seeded with
    `(seed, call seed, task index, examples seen so far)`, so a run that resumes from `state_dict` draws the same.
    """

    def __init__(self, capacity: int, seed: int = 0):
        if capacity < 0:
            raise ValueError(f"Buffer capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.seed = int(seed)
        self.num_seen = 0
        self._tasks: list[int] = []
        self._rows: list[int] = []

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def refs(self) -> list[tuple[int, int]]:
        """`(task index, row index)` of every slot, in slot order."""
        return list(zip(self._tasks, self._rows, strict=True))

    def slot_tasks(self) -> np.ndarray:
        """The task index of every slot (int64 [len(self)])."""
        return np.asarray(self._tasks, dtype=np.int64)

    def set_capacity(self, capacity: int) -> None:
        """Change the budget before the reservoir has seen any example (a method whose default budget depends on
        the stream it trains)."""
        if self.num_seen:
            raise ValueError(f"The buffer budget is fixed once examples are seen ({self.num_seen} seen)")
        if capacity < 0:
            raise ValueError(f"Buffer capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)

    def task_counts(self) -> dict[int, int]:
        """How many slots hold examples of each task."""
        counts: dict[int, int] = {}
        for task in self._tasks:
            counts[task] = counts.get(task, 0) + 1
        return counts

    # ----- Algorithm R ------------------------------------------------------------------------------------------
    def add_task(self, task_index: int, num_rows: int, seed: int = 0) -> list[int]:
        """Let the reservoir see rows `0..num_rows-1` of task `task_index`, in a seeded random order.

        Returns the slots whose content changed (sorted): they now hold rows of this task.
        """
        if num_rows <= 0:
            return []
        rng = np.random.default_rng([self.seed, int(seed), int(task_index), self.num_seen])
        order = rng.permutation(num_rows)
        slots = reservoir_slots(self.num_seen, num_rows, self.capacity, rng)
        self.num_seen += num_rows
        changed: set[int] = set()
        for row, slot in zip(order[slots >= 0].tolist(), slots[slots >= 0].tolist(), strict=True):
            if slot == len(self._tasks):
                self._tasks.append(int(task_index))
                self._rows.append(int(row))
            else:
                self._tasks[slot], self._rows[slot] = int(task_index), int(row)
            changed.add(slot)
        return sorted(changed)

    # ----- materialisation --------------------------------------------------------------------------------------
    def dataset(
        self,
        stream: TaskStream,
        slots: Sequence[int] | None = None,
        slot_column: str | None = None,
        caption_index: Sequence[int] | None = None,
    ) -> Dataset:
        """The buffered rows as a canonical `datasets.Dataset`, in the order of `slots` (default: every slot).

        Without `slot_column` and `caption_index` the rows are `select`ed views of the tasks' train splits (nothing
        copied). `slot_column` adds an int64 column with each row's slot; `caption_index[slot]` keeps only that
        caption of `texts`. Either copies the selected rows once (at most `capacity` of them).
        """
        slots = list(range(len(self))) if slots is None else [int(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError("Buffer slots to materialise must be distinct")
        self._check_refs(stream, slots)
        if not slots:
            raise ValueError("No buffer slots to materialise (the buffer is empty)")
        dataset = self._select(stream, slots)
        if slot_column is None and caption_index is None:
            return dataset
        return _annotate(dataset, slots, slot_column, caption_index)

    def _select(self, stream: TaskStream, slots: list[int]) -> Dataset:
        """Rows of `slots` from each task's train split, concatenated, then put in `slots` order."""
        parts, position, start = [], {}, 0
        for task in sorted({self._tasks[s] for s in slots}):
            chosen = [s for s in slots if self._tasks[s] == task]
            position.update({s: start + k for k, s in enumerate(chosen)})
            parts.append(stream.tasks[task].train.select([self._rows[s] for s in chosen]))
            start += len(chosen)
        combined = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
        order = [position[s] for s in slots]
        return combined if order == list(range(len(order))) else combined.select(order)

    def _check_refs(self, stream: TaskStream, slots: list[int]) -> None:
        for slot in slots:
            if not 0 <= slot < len(self):
                raise IndexError(f"Buffer slot {slot} out of range (the buffer holds {len(self)})")
            task, row = self._tasks[slot], self._rows[slot]
            if task >= len(stream) or row >= len(stream.tasks[task].train):
                raise ValueError(
                    f"Buffer slot {slot} refers to task {task}, row {row}, which stream {stream.name!r} does not have "
                    f"({len(stream)} tasks); was the buffer built on another stream or subsample?"
                )

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Capacity, seed, count seen (JSON) and the references as int64 tensors (safetensors)."""
        return {
            "capacity": self.capacity,
            "seed": self.seed,
            "num_seen": self.num_seen,
            "task_index": torch.tensor(self._tasks, dtype=torch.int64),
            "row_index": torch.tensor(self._rows, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tasks = torch.as_tensor(state["task_index"]).tolist()
        rows = torch.as_tensor(state["row_index"]).tolist()
        if len(tasks) != len(rows) or len(tasks) > int(state["capacity"]):
            raise ValueError(f"Inconsistent buffer state: {len(tasks)} tasks, {len(rows)} rows, capacity {state['capacity']}")
        self.capacity, self.seed, self.num_seen = int(state["capacity"]), int(state["seed"]), int(state["num_seen"])
        self._tasks, self._rows = [int(t) for t in tasks], [int(r) for r in rows]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ReservoirBuffer:
        buffer = cls(int(state["capacity"]))
        buffer.load_state_dict(state)
        return buffer

    def __repr__(self) -> str:
        return f"ReservoirBuffer({len(self)}/{self.capacity} slots, {self.num_seen} seen, per task {self.task_counts()})"


def reservoir_slots(num_seen: int, count: int, capacity: int, rng: np.random.Generator) -> np.ndarray:
    """Algorithm R for the next `count` examples after `num_seen`: the slot each one writes, or -1 (discarded).

    The i-th example overall (1-based) fills slot i-1 while i <= capacity, else draws j ~ U{0..i-1} and replaces
    slot j if j < capacity. One draw per example past the capacity, in arrival order.
    """
    position = np.arange(num_seen + 1, num_seen + count + 1, dtype=np.int64)
    slots = position - 1
    late = position > capacity
    if late.any():
        draws = rng.integers(0, position[late])
        slots[late] = np.where(draws < capacity, draws, -1)
    return slots


def _annotate(
    dataset: Dataset, slots: list[int], slot_column: str | None, caption_index: Sequence[int] | None
) -> Dataset:
    """Add the slot column and/or keep one caption per row (one batched map over the buffered rows)."""
    features = Features(dict(dataset.features))
    if slot_column is not None:
        features[slot_column] = Value("int64")

    def apply(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        if slot_column is not None:
            out[slot_column] = [slots[i] for i in indices]
        if caption_index is not None:
            out["texts"] = [[texts[caption_index[slots[i]]]] for texts, i in zip(batch["texts"], indices, strict=True)]
        return out

    with quiet_progress_bars():
        return dataset.map(apply, batched=True, with_indices=True, features=features, desc="Replay buffer")
