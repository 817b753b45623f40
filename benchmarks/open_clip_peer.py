"""open_clip's own training step on a CLIP of the same architecture as an HF `CLIPConfig`: a peer for the speed table.

The step is that of `open_clip_train.train.train_one_epoch` (open_clip_torch 3.x) with `accum_freq` 1, fp32 (or
bf16 autocast), no gradient clipping (its default): `optimizer.zero_grad()`, `model(images, texts)` with
`output_dict=True`, `ClipLoss` (one process), backward, `optimizer.step()`, then `logit_scale.clamp_(0, ln 100)`.
The optimizer is `open_clip_train.main`'s: `torch.optim.AdamW` with torch's default implementation, no weight
decay on gains, biases and `logit_scale`, betas (0.9, 0.98), eps 1e-6 (its ViT settings).

The model is `open_clip.model.CLIP(embed_dim, CLIPVisionCfg, CLIPTextCfg, quick_gelu=True)` with the widths,
layers, heads, patch and image size of the HF config (HF's CLIP uses QuickGELU), random weights, and a text context
as long as the batch's token ids: open_clip's own tokenizer pads every caption to 77 tokens, while HF pads to the
longest caption, so the peer is given the same L-token ids as hf_ccl (the same work; its causal mask and argmax
pooling at the end-of-text token give the same text features as HF's padding mask).

open_clip imports torchvision at package import, and only its ResNet towers use it (`FrozenBatchNorm2d`). Where
torchvision cannot be imported (on this CPU machine the registry's torchvision wheel is a CUDA build that fails to
load beside torch+cpu, and installing it would break transformers' image processors), `load_open_clip` imports
`open_clip.model` and `open_clip.loss` without the package's `__init__`, with a stand-in for that one class
(removed from `sys.modules` right after): the ViT towers and the loss are open_clip's own code either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import CLIPConfig

#: What the peer row says when open_clip cannot be had.
NOT_INSTALLED = "not installed (pip install 'hf_ccl[bench]', or open_clip_torch --no-deps where torchvision breaks)"


def load_open_clip() -> tuple[Any, Any] | str:
    """(open_clip.model, open_clip.loss), or the reason they cannot be imported."""
    if importlib.util.find_spec("open_clip") is None:
        return NOT_INSTALLED
    try:
        import open_clip.loss
        import open_clip.model
        return open_clip.model, open_clip.loss
    except (ImportError, RuntimeError, OSError) as error:  # torchvision missing, or a build that fails to load
        reason = f"{type(error).__name__}: {error}"
    for name in [name for name in sys.modules if name == "open_clip" or name.startswith("open_clip.")]:
        del sys.modules[name]
    try:
        return _import_without_torchvision()
    except Exception as error:  # noqa: BLE001 (any failure: the row says why)
        return f"open_clip could not be imported ({reason}; without torchvision: {type(error).__name__}: {error})"


def _import_without_torchvision() -> tuple[Any, Any]:
    """`open_clip.model` and `open_clip.loss` without the package `__init__` (which imports torchvision's transforms)
    and with a stand-in for `torchvision.ops.misc.FrozenBatchNorm2d` (ResNet towers only) while they import."""
    spec = importlib.util.find_spec("open_clip")
    assert spec is not None and spec.submodule_search_locations is not None
    package = types.ModuleType("open_clip")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    stand_ins = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.ops", "torchvision.ops.misc")}
    stand_ins["torchvision.ops.misc"].FrozenBatchNorm2d = type("FrozenBatchNorm2d", (torch.nn.Module,), {})  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    sys.modules["open_clip"] = package
    try:
        model, loss = importlib.import_module("open_clip.model"), importlib.import_module("open_clip.loss")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return model, loss


def open_clip_model(config: CLIPConfig, context_length: int) -> torch.nn.Module:
    """open_clip's CLIP with the architecture of `config` (random weights, seed 0)."""
    loaded = load_open_clip()
    if isinstance(loaded, str):
        raise ImportError(loaded)
    model_module, _ = loaded
    vision, text = config.vision_config, config.text_config
    vision_cfg = model_module.CLIPVisionCfg(
        layers=vision.num_hidden_layers, width=vision.hidden_size, head_width=vision.hidden_size // vision.num_attention_heads,
        mlp_ratio=vision.intermediate_size / vision.hidden_size, patch_size=vision.patch_size, image_size=vision.image_size)
    text_cfg = model_module.CLIPTextCfg(
        context_length=context_length, vocab_size=text.vocab_size, width=text.hidden_size, heads=text.num_attention_heads,
        layers=text.num_hidden_layers, mlp_ratio=text.intermediate_size / text.hidden_size)
    torch.manual_seed(0)
    return model_module.CLIP(config.projection_dim, vision_cfg, text_cfg, quick_gelu=True, output_dict=True)


def open_clip_step(config: CLIPConfig, batch: dict[str, torch.Tensor], device: torch.device, bf16: bool = False,
                   lr: float = 1e-5) -> Callable[[], None]:
    """One training step of open_clip (`open_clip_train.train.train_one_epoch`, accum_freq 1) on `batch`'s
    `pixel_values` and `input_ids`, as a function."""
    loaded = load_open_clip()
    if isinstance(loaded, str):
        raise ImportError(loaded)
    _, loss_module = loaded
    images = batch["pixel_values"].to(device)
    texts = batch["input_ids"].to(device)
    model = open_clip_model(config, texts.shape[1]).to(device).train()
    loss = loss_module.ClipLoss()

    def exclude(name: str, parameter: torch.nn.Parameter) -> bool:  # open_clip_train.main's weight-decay rule
        return parameter.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": 0.2}],
        lr=lr, betas=(0.9, 0.98), eps=1e-6)

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(images, texts)
            total = sum(loss(**out, output_dict=True).values())
        total.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return step
