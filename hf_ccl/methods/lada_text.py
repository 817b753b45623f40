"""LADA's text side as the paper builds it (its preliminary framework and Appendix B): an AdaptFormer on the text
tower, fresh for each task, whose outputs for the task's class prompts are the task's text features t^k_j.

AdaptFormer (Chen et al., NeurIPS 2022): beside every encoder layer's MLP, a bottleneck adapter on the residual stream
x (what enters `layer_norm2`), layer(x) = x + MLP(LN_2(x)) + s up(ReLU(down(x))), `up` initialised at zero so that
the task starts from the zero-shot text features. It is installed with two hooks per text layer (as MoE-Adapters' experts,
`hf_ccl.methods.moe_adapters.ExpertAdapter`, without routing) while the task trains; after it, the class features it
produces are stored as frozen vectors in the memory and the adapter is removed (the paper freezes t^i_j of earlier
tasks, so nothing else of it is needed). Families without CLIP-style pre-norm text layers (AltCLIP, Chinese-CLIP) are
refused (`check_layers`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .moe_adapters import ExpertAdapter, check_layers

#: The attribute the adapter is attached to the model under while a task trains.
ATTRIBUTE = "lada_text"


class TextAdaptFormer(nn.Module):
    """One bottleneck adapter per text encoder layer, parallel to its MLP, active while installed."""

    def __init__(self, model: nn.Module, bottleneck: int, scale: float, generator: torch.Generator | None = None):
        super().__init__()
        layers = check_layers(model, ["text"])["text"]
        self.adapters = nn.ModuleList(
            ExpertAdapter(layer.layer_norm2.normalized_shape[0], bottleneck, scale, 0.0, generator)
            for layer in layers)
        self._layers = layers
        self._handles: list[RemovableHandle] = []
        self._inputs: list[torch.Tensor | None] = [None] * len(layers)

    def install(self) -> None:
        """Hook every text layer: its residual stream is stashed before `layer_norm2`, the adapter's output added to
        its `mlp`'s."""
        for index, layer in enumerate(self._layers):
            self._handles.append(layer.layer_norm2.register_forward_pre_hook(self._stash(index)))
            self._handles.append(layer.mlp.register_forward_hook(self._add(index)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _stash(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._inputs[index] = args[0]
        return hook

    def _add(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            x, self._inputs[index] = self._inputs[index], None
            if x is None:
                raise RuntimeError(f"LADA text adapter {index}: the mlp ran without layer_norm2 before it")
            return output + self.adapters[index](x)
        return hook


def added_parameters(model: nn.Module, bottleneck: int) -> int:
    """Parameters the text adapter adds to `model` (meta or real): 2 D r + r + D per text layer."""
    return sum(2 * layer.layer_norm2.normalized_shape[0] * bottleneck + bottleneck
               + layer.layer_norm2.normalized_shape[0] for layer in check_layers(model, ["text"])["text"])
