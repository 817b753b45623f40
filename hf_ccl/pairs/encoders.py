"""Frozen modality encoders: what turns a modality's raw values into the features z*_m its learner head reads.

CMCL keeps the pretrained "binding" encoders frozen and trains only the heads (spec cmcl.md §2.1). An encoder here
is anything with a `dim` and an `encode(values) -> Tensor[n, dim]`: a CLIP tower (`CLIPImageEncoder`,
`CLIPTextEncoder`; several text modalities may share one), a precomputed feature column (`PrecomputedEncoder`), or
any callable, e.g. an audio or depth model (`CallableEncoder`). Features are computed once per task and cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from transformers import CLIPModel

from ..evaluation.encode import encode_images, encode_texts


@runtime_checkable
class ModalityEncoder(Protocol):
    """A frozen encoder: `encode(values)` → float32 [len(values), dim] on the CPU, no gradients."""

    dim: int

    def encode(self, values: Sequence[Any]) -> torch.Tensor: ...


def _finish(features: torch.Tensor, dim: int, normalize: bool, what: str) -> torch.Tensor:
    features = features.detach().float().cpu()
    if features.ndim != 2 or features.shape[1] != dim:
        raise ValueError(f"{what} returned shape {tuple(features.shape)}, expected [n, {dim}]")
    if not torch.isfinite(features).all():
        raise ValueError(f"{what} returned NaN or infinite features")
    return F.normalize(features, dim=-1) if normalize else features


class CLIPImageEncoder:
    """CLIP's vision tower and `visual_projection`, frozen: z* = normalize(P_v pool(x)) (spec §2.6), the input
    `fold_into_clip` assumes."""

    def __init__(self, clip: CLIPModel, image_processor: Any, batch_size: int = 256, normalize: bool = True):
        self.clip, self.image_processor = clip, image_processor
        self.batch_size, self.normalize = batch_size, normalize
        self.dim = int(clip.config.projection_dim)

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        features = encode_images(self.clip, self.image_processor, values, batch_size=self.batch_size)
        return _finish(features, self.dim, self.normalize, "CLIPImageEncoder")


class CLIPTextEncoder:
    """CLIP's text tower and `text_projection`, frozen: z* = normalize(P_t pool(tokens)). A cell holding a list of
    captions is read as its first caption."""

    def __init__(
        self,
        clip: CLIPModel,
        tokenizer: Any,
        batch_size: int = 512,
        max_length: int | None = None,
        normalize: bool = True,
    ):
        self.clip, self.tokenizer = clip, tokenizer
        self.batch_size, self.max_length, self.normalize = batch_size, max_length, normalize
        self.dim = int(clip.config.projection_dim)

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        texts = []
        for i, value in enumerate(values):
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if not isinstance(value, str):
                raise ValueError(f"CLIPTextEncoder: row {i} holds {type(value).__name__}, expected a string")
            texts.append(value)
        features = encode_texts(
            self.clip, self.tokenizer, texts, batch_size=self.batch_size, max_length=self.max_length
        )
        return _finish(features, self.dim, self.normalize, "CLIPTextEncoder")


class PrecomputedEncoder:
    """Values are already feature vectors (e.g. a column of audio embeddings computed offline)."""

    def __init__(self, dim: int, normalize: bool = False):
        self.dim, self.normalize = dim, normalize

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        features = torch.as_tensor(np.asarray(list(values), dtype=np.float32))
        return _finish(features.reshape(len(features), -1), self.dim, self.normalize, "PrecomputedEncoder")


class CallableEncoder:
    """Any frozen model as a function of a list of raw values, e.g. an audio or depth encoder; it runs under
    `torch.no_grad()` in batches of `batch_size`."""

    def __init__(
        self,
        function: Callable[[list[Any]], torch.Tensor],
        dim: int,
        batch_size: int = 256,
        normalize: bool = True,
    ):
        self.function, self.dim, self.batch_size, self.normalize = function, dim, batch_size, normalize

    def encode(self, values: Sequence[Any]) -> torch.Tensor:
        values = list(values)
        with torch.no_grad():
            chunks = [
                torch.as_tensor(self.function(values[i : i + self.batch_size]))
                for i in range(0, len(values), self.batch_size)
            ]
        features = torch.cat(chunks) if chunks else torch.empty(0, self.dim)
        return _finish(features, self.dim, self.normalize, "CallableEncoder")


def clip_encoders(
    clip: CLIPModel,
    image_processor: Any,
    tokenizer: Any,
    image_modalities: Sequence[str] = ("image",),
    text_modalities: Sequence[str] = ("en", "de", "fr"),
) -> dict[str, ModalityEncoder]:
    """Encoders for a CLIP: one shared vision encoder for every image modality and one shared text encoder for
    every text modality (each modality still gets its own head)."""
    clip.eval().requires_grad_(False)
    image = CLIPImageEncoder(clip, image_processor)
    text = CLIPTextEncoder(clip, tokenizer)
    encoders: dict[str, ModalityEncoder] = {m: image for m in image_modalities}
    encoders.update({m: text for m in text_modalities})
    return encoders
