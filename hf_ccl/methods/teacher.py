"""Frozen teachers for distillation methods (Mod-X, LwF, CTP, DER): a copy of the model that is never stepped.

The teacher of task t is the model as it was when task t started, i.e. after task t-1. Taking the snapshot at task
start (not at the previous task's end) means a resumed run rebuilds exactly the same teacher from the checkpoint,
with nothing extra to save.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from ..distributed import all_gather_no_grad
from ..modeling import ContinualDualEncoder


class FrozenTeacher:
    """A frozen deep copy of a CLIP model: eval mode, `requires_grad=False`, used only under `torch.no_grad()`.

    With `cache=True`, embeddings are kept per image hash and per text hash for the life of the teacher (one task),
    so each example is encoded once per task instead of once per epoch. Only valid when the teacher's input for a
    given hash never changes (no random augmentation), which holds for `CLIPCollator`.
    """

    def __init__(self, model: ContinualDualEncoder, cache: bool = False):
        self.model = copy.deepcopy(model)
        self.model.eval()
        self.model.requires_grad_(False)
        self.cache = cache
        self._image_cache: dict[int, torch.Tensor] = {}
        self._text_cache: dict[int, torch.Tensor] = {}
        self.encoded_images = 0  # examples actually run through the teacher (for tests and benchmarks)
        self.encoded_texts = 0

    def to(self, device: torch.device | str) -> FrozenTeacher:
        self.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) types PreTrainedModel.to unbound
        return self

    def train(self, mode: bool = True) -> FrozenTeacher:  # noqa: ARG002 - a teacher stays in eval mode
        self.model.eval()
        return self

    @torch.no_grad()
    def embed(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised image and text embeddings of this process's batch, [B, D] each."""
        device = next(self.model.parameters()).device
        if self.cache and "image_hash" in inputs and "text_hash" in inputs:
            images = self._cached(
                inputs["image_hash"], self._image_cache,
                lambda rows: self._embed_images(self.model.image_inputs(inputs, rows, device)),
            )
            texts = self._cached(
                inputs["text_hash"], self._text_cache,
                lambda rows: self._embed_texts(
                    inputs["input_ids"][rows].to(device), _rows(inputs.get("attention_mask"), rows, device)
                ),
            )
            return images.to(device), texts.to(device)
        images = self._embed_images(self.model.image_inputs(inputs, device=device))
        texts = self._embed_texts(inputs["input_ids"].to(device), _to(inputs.get("attention_mask"), device))
        return images, texts

    @torch.no_grad()
    def embed_global(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`embed`, gathered over every process ([world * B, D]), in the order of `all_gather_with_grad`."""
        images, texts = self.embed(inputs)
        return all_gather_no_grad(images), all_gather_no_grad(texts)

    def _embed_images(self, image_inputs: dict[str, Any]) -> torch.Tensor:
        self.encoded_images += image_inputs["pixel_values"].shape[0]
        return self.model.embed_images(**image_inputs)

    def _embed_texts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        self.encoded_texts += input_ids.shape[0]
        return self.model.embed_texts(input_ids, attention_mask)

    @staticmethod
    def _cached(
        hashes: torch.Tensor, store: dict[int, torch.Tensor], compute: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        keys = hashes.tolist()
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        missing = sorted(i for key, i in first.items() if key not in store)
        if missing:
            computed = compute(torch.tensor(missing, device=hashes.device))
            for row, embedding in zip(missing, computed, strict=True):
                store[keys[row]] = embedding.detach()
        return torch.stack([store[key] for key in keys])

    def parameters(self):  # noqa: ANN201 - mirrors nn.Module for tests ("the teacher has no gradients")
        return self.model.parameters()


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows].to(device)


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def freeze_copy(model: ModuleT) -> ModuleT:
    """A frozen deep copy of any module (eval mode, no gradients)."""
    frozen = copy.deepcopy(model)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen
