"""Batching canonical rows for CLIP: decode and preprocess images, pick and tokenize captions, hash for positives."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..paths import default_tokenizer_path
from .images import decode_image

CLIP_MAX_LENGTH = 77
_HUGE_MAX_LENGTH = 100_000  # tokenizers without a limit report ~1e30
#: Optional integer columns passed through as int64 tensors when present in the rows (missing or None -> -1):
#: `buffer_slot` marks replayed rows and their buffer slot (hf_ccl.methods.replay; -1 for new data).
PASSTHROUGH_INT_COLUMNS = ("buffer_slot",)


def stable_hash(text: str) -> int:
    """A stable signed 64-bit hash of a string (blake2b, 8 bytes), equal across processes and runs."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def load_tokenizer(name_or_path: str | Path | None = None) -> Any:
    """Any HF tokenizer by name or path (`AutoTokenizer`); default: the bundled CLIP BPE tokenizer."""
    from transformers import AutoTokenizer

    if name_or_path is None:
        name_or_path = default_tokenizer_path()
        if not name_or_path.is_dir():
            raise FileNotFoundError(
                f"The bundled CLIP tokenizer is not at {name_or_path}: set HF_CCL_SHARED to the shared/ folder, or "
                "pass a tokenizer name or path (config key `tokenizer`)"
            )
    return AutoTokenizer.from_pretrained(str(name_or_path))


def load_image_processor(image_size: int, **kwargs: Any) -> Any:
    """A `CLIPImageProcessorPil` (no torchvision needed) resizing the short side to `image_size` and centre-cropping
    to a square; extra `kwargs` (e.g. `image_mean`) go to the constructor."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, **kwargs
    )


def resolve_max_length(tokenizer: Any, max_length: int | None = None) -> int:
    """`max_length`, else the tokenizer's `model_max_length`, clamped to CLIP's 77 when it reports no real limit."""
    if max_length is not None:
        return int(max_length)
    limit = getattr(tokenizer, "model_max_length", None)
    return CLIP_MAX_LENGTH if limit is None or limit > _HUGE_MAX_LENGTH else int(limit)


class CLIPCollator:
    """Turn a list of canonical rows (`image`, `texts`, `image_id`) into CLIP inputs.

    Returns `pixel_values`, `input_ids`, `attention_mask` (padded to the longest caption in the batch, truncated to
    `max_length`) and int64 `text_hash` / `image_hash` (stable hashes of the chosen caption and of `image_id`): two
    examples are positives when either hash matches. In train mode one caption per example is drawn from `texts`
    with the collator's own seeded generator (reproducible; each DataLoader worker derives its own stream from
    `seed` and its worker id); in eval mode the first caption is used. Integer columns named in
    `PASSTHROUGH_INT_COLUMNS` (e.g. `buffer_slot`) are passed through as int64 tensors when the rows have them.
    """

    def __init__(
        self,
        image_processor: Any,
        tokenizer: Any,
        *,
        max_length: int | None = None,
        train: bool = True,
        seed: int = 0,
    ) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.max_length = resolve_max_length(tokenizer, max_length)
        self.train = train
        self.seed = seed
        self._rng = random.Random(seed)
        self._worker: int | None = None

    def _generator(self) -> random.Random:
        info = torch.utils.data.get_worker_info()
        worker = None if info is None else info.id
        if worker != self._worker:
            self._worker = worker
            self._rng = random.Random(self.seed if worker is None else f"{self.seed}/worker{worker}")
        return self._rng

    def state_dict(self) -> dict[str, Any]:
        """The caption sampler's position, so a run resumed mid-task draws the captions it would have drawn."""
        version, internal, gauss = self._rng.getstate()
        return {"seed": self.seed, "worker": self._worker, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.seed, self._worker = state["seed"], state["worker"]
        self._rng.setstate((version, tuple(internal), gauss))

    def choose_texts(self, rows: Sequence[Mapping[str, Any]]) -> list[str]:
        """One caption per row: a seeded random one in train mode, the first in eval mode."""
        rng = self._generator() if self.train else None
        chosen = []
        for row in rows:
            texts = row["texts"]
            if isinstance(texts, str):
                texts = [texts]
            if not texts:
                raise ValueError(f"Example {row.get('image_id', '?')} has no caption")
            chosen.append(texts[rng.randrange(len(texts))] if rng is not None else texts[0])
        return chosen

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [str(row.get("image_id", index)) for index, row in enumerate(rows)]
        images = [decode_image(row["image"], where) for row, where in zip(rows, ids, strict=True)]
        texts = self.choose_texts(rows)
        tokens = self.tokenizer(
            texts, padding="longest", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        batch = {
            "pixel_values": pixels,
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "text_hash": torch.tensor([stable_hash(text) for text in texts], dtype=torch.int64),
            "image_hash": torch.tensor([stable_hash(image_id) for image_id in ids], dtype=torch.int64),
        }
        for column in PASSTHROUGH_INT_COLUMNS:
            if any(column in row for row in rows):
                values = [row.get(column) for row in rows]
                batch[column] = torch.tensor([-1 if v is None else int(v) for v in values], dtype=torch.int64)
        return batch
