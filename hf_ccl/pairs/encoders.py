"""Frozen modality encoders of the older pair learner: the classes live in `hf_ccl.pair_features` (the one loop's
pair tasks); `clip_encoders` builds the CLIP ones for `PairStreamLearner`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import CLIPModel

from ..pair_features import (
    CallableEncoder,
    CLIPImageEncoder,
    CLIPTextEncoder,
    ModalityEncoder,
    PrecomputedEncoder,
)

__all__ = ["CLIPImageEncoder", "CLIPTextEncoder", "CallableEncoder", "ModalityEncoder", "PrecomputedEncoder",
           "clip_encoders"]


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
