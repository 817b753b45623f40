"""Reuse of eval embeddings that cannot have changed: a frozen tower's, on the same data, tokenizer and processor.

`EmbeddingCache` keeps, per task and kind (images, texts, class embeddings), the last embeddings computed and the
`Fingerprint` of exactly what produced them. `EmbeddingCache.session(...)` opens one evaluation pass of a model: each
tower, the tokenizer and the processor are fingerprinted once per pass (lazily, when first needed), and an entry is
reused only when its fingerprint matches; otherwise it is recomputed and replaced. Never a stale embedding: any change
of a tower's weights (an optimizer step, `load_state_dict`, a `param.data = ...` swap or an in-place edit), of the
model object, its config or adapters, of the tokenizer (a grown vocabulary), the processor, the batch size, the token
limit or the eval rows gives another fingerprint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .encode import unwrap
from .fingerprint import (
    Fingerprint,
    Tower,
    dataset_fingerprint,
    processor_fingerprint,
    tokenizer_fingerprint,
    tower_fingerprint,
)


@dataclass
class _Entry:
    fingerprint: Fingerprint
    value: torch.Tensor


class EmbeddingCache:
    """Eval embeddings by (task, kind), each with the fingerprint of what produced it; `hits`/`misses` count uses."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _Entry] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (e.g. after changing a model's forward code in place, which no fingerprint sees)."""
        self._entries.clear()

    def session(
        self, model: torch.nn.Module, tokenizer: Any, image_processor: Any, *, batch_size: int, max_length: int | None
    ) -> CacheSession:
        """One evaluation pass of `model` (which must not change during the pass)."""
        return CacheSession(self, unwrap(model), tokenizer, image_processor, batch_size, max_length)

    def lookup(self, key: tuple[str, str], fingerprint: Fingerprint, compute: Callable[[], torch.Tensor]
               ) -> torch.Tensor:
        """The entry under `key` if its fingerprint matches, else `compute()` (stored under `key`)."""
        entry = self._entries.get(key)
        if entry is not None and entry.fingerprint.matches(fingerprint):
            self.hits += 1
            return entry.value
        self.misses += 1
        value = compute()
        self._entries[key] = _Entry(fingerprint, value)
        return value


class CacheSession:
    """An evaluation pass through an `EmbeddingCache`: `images` and `texts` (captions or class prompts) reuse or compute."""

    def __init__(self, cache: EmbeddingCache, model: torch.nn.Module, tokenizer: Any, image_processor: Any,
                 batch_size: int, max_length: int | None) -> None:
        self.cache = cache
        self.model, self.tokenizer, self.image_processor = model, tokenizer, image_processor
        self.settings = {"batch_size": batch_size, "max_length": max_length}
        self._fingerprints: dict[str, Fingerprint] = {}

    def _part(self, name: str) -> Fingerprint:
        if name not in self._fingerprints:
            if name in ("image", "text"):
                tower: Tower = "image" if name == "image" else "text"
                self._fingerprints[name] = tower_fingerprint(self.model, tower)
            elif name == "tokenizer":
                self._fingerprints[name] = tokenizer_fingerprint(self.tokenizer)
            else:
                self._fingerprints[name] = processor_fingerprint(self.image_processor)
        return self._fingerprints[name]

    def images(self, task_name: str, dataset: Any, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The image embeddings of `dataset` (a task's eval rows)."""
        fingerprint = self._part("image").combine(
            self._part("processor"), dataset_fingerprint(dataset), extra=self.settings["batch_size"])
        return self.cache.lookup((task_name, "images"), fingerprint, compute)

    def texts(self, task_name: str, dataset: Any, texts: Iterable[Any], compute: Callable[[], torch.Tensor],
              kind: str = "texts") -> torch.Tensor:
        """Text-side embeddings of `dataset` computed from `texts` (captions; or, with `kind`, what class prompts are
        built from: `[class names, templates]`)."""
        fingerprint = self._part("text").combine(
            self._part("tokenizer"), dataset_fingerprint(dataset, texts), extra=self.settings)
        return self.cache.lookup((task_name, kind), fingerprint, compute)
