"""Helpers for testing pipelines built on hf_ccl: tiny model sizes that train in seconds on a CPU."""

from __future__ import annotations

import torch

from ..modeling import ContinualCLIPModel, tiny_clip_config

#: A 1-layer, 32-wide CLIP on 32 px images with the real 49,408-token vocabulary: trains at dozens of steps/s.
TINY_CLIP = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}


def tiny_clip(seed: int = 0, **overrides: int) -> ContinualCLIPModel:
    """A seeded random tiny CLIP (TINY_CLIP sizes, overridable)."""
    torch.manual_seed(seed)
    return ContinualCLIPModel(tiny_clip_config(**{**TINY_CLIP, **overrides}))
