"""Helpers for testing pipelines built on hf_ccl: tiny model sizes that train in seconds on a CPU, and a local
Hugging Face Hub server (`LocalHubServer`) to test pushes and downloads without any network.

Importing this package is cheap: torch and transformers are imported only when a tiny model is built, and no server
starts until asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..callbacks import StreamControl, StreamState, TaskCallback

if TYPE_CHECKING:
    from ..arguments import ContinualArguments
    from ..modeling import ContinualCLIPModel, ContinualDualEncoder
    from .hub_server import (
        FaultPlan,
        HubStore,
        LocalHubServer,
        LoggedRequest,
        local_hub_endpoint,
        local_hub_process,
    )

_HUB_SERVER_NAMES = {"FaultPlan", "HubStore", "LocalHubServer", "LoggedRequest", "local_hub_endpoint", "local_hub_process"}

__all__ = [
    "TINY_CLIP",
    "FaultPlan",
    "HubStore",
    "LocalHubServer",
    "LoggedRequest",
    "StopAfterTask",
    "TrainingLogRecorder",
    "local_hub_endpoint",
    "local_hub_process",
    "tiny_clip",
    "random_image_inputs",
    "tiny_model",
]

#: A 1-layer, 32-wide CLIP on 32 px images with the real 49,408-token vocabulary: trains at dozens of steps/s.
TINY_CLIP = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}


def tiny_clip(seed: int = 0, **overrides: int) -> ContinualCLIPModel:
    """A seeded random tiny CLIP (TINY_CLIP sizes, overridable)."""
    return tiny_model("clip", seed, **overrides)  # type: ignore[return-value]


def tiny_model(family: str = "clip", seed: int = 0, **overrides: int) -> ContinualDualEncoder:
    """A seeded random tiny model of any family (`hf_ccl.families`) at the TINY_CLIP sizes (overridable), with the
    bundled CLIP tokenizer's vocabulary."""
    import torch

    from ..families import family_class, tiny_config

    torch.manual_seed(seed)
    return family_class(family)(tiny_config(family, **{**TINY_CLIP, **overrides}))


def random_image_inputs(model: ContinualDualEncoder, count: int = 2, seed: int = 0) -> dict[str, Any]:
    """`count` random RGB images (40 x 48) through the model family's image processor: the image tower's inputs
    (`pixel_values`; SigLIP 2's also its patches' mask and grid), as `embed_images(**...)` takes them."""
    import numpy as np
    from PIL import Image

    from ..families import default_image_processor

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)) for _ in range(count)]
    return dict(default_image_processor(model)(images=images, return_tensors="pt"))


class TrainingLogRecorder(TaskCallback):
    """A task callback that keeps each trained task's Trainer log history (`logs[k]` for the k-th task trained;
    `step_logs(k)` only the per-step entries, those with a loss). Pass it in `task_callbacks`."""

    def __init__(self) -> None:
        self.logs: list[list[dict[str, Any]]] = []

    def on_task_trained(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self.logs.append(list(kwargs["context"].log_history))

    def step_logs(self, index: int) -> list[dict[str, Any]]:
        return [log for log in self.logs[index] if "loss" in log]


class StopAfterTask(TaskCallback):
    """A task callback that ends the stream after task `index` (its checkpoint is written), as an interrupted run
    would stop; resume it with `resume_from_checkpoint=True`."""

    def __init__(self, index: int) -> None:
        self.index = index

    def on_task_end(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        control.should_stop = state.task_index == self.index


def __getattr__(name: str) -> Any:
    """The hub server's names, imported on first use (so `python -m hf_ccl.testing.hub_server` runs it once)."""
    if name in _HUB_SERVER_NAMES:
        from . import hub_server

        return getattr(hub_server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
