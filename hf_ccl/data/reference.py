"""Reference data: images and texts from outside the stream that a method reads at every training step (ZSCL's
reference dataset), batched by the loop so that no method builds its own collator.

A method returns a `ReferenceData` from its `reference_data` hook; the loop wraps it in `ReferenceBatches` with the
task's tokenizer, image processor and padding, and the method reads `context.reference_batch(self)` in `loss_terms`.

The batch of optimizer step s is drawn from a generator seeded by (seed, task, s), images and texts independently
(ZSCL pairs ImageNet images with Conceptual Captions texts: reference images and texts are not pairs), so a run
resumed mid-task draws exactly the batches it would have drawn, with no sampler state to save, and every process of
a distributed run draws the same batch (its gradient is then the single-process one after DDP's average).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset

from .builders import TaskSource, stream_from_datasets
from .stream_registry import bundled


@dataclass
class ReferenceData:
    """Canonical rows (`image`, `texts`) to draw `batch_size` images and `batch_size` texts from at every step."""

    dataset: Dataset
    batch_size: int

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"reference batch_size must be >= 1, got {self.batch_size}")
        if len(self.dataset) == 0:
            raise ValueError("the reference dataset is empty")
        missing = {"image", "texts"} - set(self.dataset.column_names)
        if missing:
            raise ValueError(f"the reference dataset lacks the column(s) {sorted(missing)} (build it with "
                             "hf_ccl.data.reference.load_reference)")


def load_reference(source: str, *, text_column: str = "en", split: str = "train", examples: int | None = None,
                   seed: int = 0, data_root: Path | None = None) -> Dataset:
    """A reference set in the canonical schema: `source` is a bundled dataset folder name (e.g. `flickr8k`, under the
    data root), a local folder or a Hub dataset id; `examples` rows of its `split` are kept (a seeded sample)."""
    from ..paths import data_root as default_root

    root = Path(data_root) if data_root is not None else default_root()
    location: Any = bundled(root, source) if (root / source).is_dir() else source
    entry = TaskSource(name="reference", train=location, text_column=text_column, train_split=split,
                       eval_split=split)
    stream = stream_from_datasets([entry], name="reference", max_train_per_task=examples, max_eval_per_task=1,
                                  seed=seed)
    return stream.tasks[0].train


class ReferenceBatches:
    """The reference batch of each optimizer step of one task, collated like the task's own batches."""

    def __init__(self, data: ReferenceData, collator: Any, seed: int, task_index: int):
        self.data, self.collator = data, collator
        self.seed, self.task_index = int(seed), int(task_index)
        self._texts = data.dataset.select_columns(["texts"])["texts"]  # read once: no image bytes per text draw

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The image rows, the text rows and each text row's caption index of optimizer step `step`."""
        rng = np.random.default_rng([self.seed, self.task_index, int(step)])
        n, size = len(self.data.dataset), min(self.data.batch_size, len(self.data.dataset))
        images = rng.choice(n, size=size, replace=False)
        texts = rng.choice(n, size=size, replace=False)
        return images, texts, rng.integers(0, 1 << 30, size=size)

    def batch(self, step: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The image inputs (`pixel_values`, ...) and the tokenized texts (`input_ids`, `attention_mask`) of step
        `step`, on `device`."""
        image_rows, text_rows, picks = self.rows(step)
        dataset = self.data.dataset
        rows = [dataset[int(i)] for i in image_rows]
        batch = dict(self.collator.image_inputs(rows, [f"reference/{int(i)}" for i in image_rows]))
        captions = [self._texts[int(i)] for i in text_rows]
        texts = [caption[int(pick) % len(caption)] for caption, pick in zip(captions, picks, strict=True)]
        tokens = self.collator.tokenizer(texts, padding=self.collator.padding, truncation=True,
                                         max_length=self.collator.max_length, return_tensors="pt")
        batch["input_ids"], batch["attention_mask"] = tokens["input_ids"], tokens["attention_mask"]
        return {name: _to_device(value, device) if device is not None else value for name, value in batch.items()}


def _to_device(value: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of host tensor `value` on `device` that the host does not wait for: from pinned memory on a GPU (a copy
    from pageable memory synchronises the stream), into a tensor made on the device (ordered before the kernels that
    read it)."""
    device = torch.device(device)
    source = value.pin_memory() if device.type == "cuda" else value
    return torch.empty(value.shape, dtype=value.dtype, device=device).copy_(source, non_blocking=True)
