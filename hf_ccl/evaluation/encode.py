"""Embed images and texts with any `CLIPModel` (or subclass) in batches, without gradients."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..data.images import decode_image
from ..modeling import as_embedding


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The CLIP model inside a DDP / `accelerate` wrapper (anything with `.module`), or the model itself."""
    while not hasattr(model, "get_image_features") and hasattr(model, "module"):
        model = model.get_submodule("module")
    return model


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless module)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Put the model in eval mode without gradients; restore its previous training mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _batches(values: Iterable[Any], batch_size: int) -> Iterator[list[Any]]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batch: list[Any] = []
    for value in values:
        batch.append(value)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def _empty(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    dim = getattr(model, "embed_dim", None) or getattr(getattr(model, "config", None), "projection_dim", 0) or 0
    return torch.empty((0, dim), device=device)


def encode_images(
    model: torch.nn.Module,
    image_processor: Any,
    images_column_values: Iterable[Any],
    *,
    batch_size: int = 256,
    where_prefix: str = "images",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Embed images (canonical `image` cells, PIL images or bytes) with `model.get_image_features`.

    Each value is decoded with `decode_image` (a bad one raises naming `"<where_prefix>/row <i>"`), preprocessed by
    `image_processor(..., return_tensors="pt")` and embedded in eval mode under `torch.no_grad()`. `values` may be
    any iterable (a list, a `datasets` column, a generator), so only one batch of decoded images is in memory.

    Returns a float32 `[N, d]` tensor on `device` (default: the model's device), not normalised.
    """
    model = unwrap(model)
    device = torch.device(device) if device is not None else model_device(model)
    dtype = _floating_dtype(model)
    image_features: Any = model.get_image_features  # a CLIP-style model's; `nn.Module` does not declare it
    chunks: list[torch.Tensor] = []
    row = 0
    with eval_mode(model):
        for batch in _batches(images_column_values, batch_size):
            images = [decode_image(value, f"{where_prefix}/row {row + i}") for i, value in enumerate(batch)]
            row += len(batch)
            processed = image_processor(images=images, return_tensors="pt")
            inputs = {name: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
                      for name, value in processed.items()}  # SigLIP 2: its patches' mask and grid as well
            output = image_features(**inputs)
            chunks.append(as_embedding(output).float())
    return torch.cat(chunks) if chunks else _empty(model, device)


def default_max_length(model: torch.nn.Module, tokenizer: Any) -> int | None:
    """The smaller of the tokenizer's `model_max_length` and the text tower's position count."""
    limits = []
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    positions = getattr(model, "max_text_positions", None) or getattr(text_config, "max_position_embeddings", None)
    if isinstance(positions, int):
        limits.append(positions)
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 1_000_000:
        limits.append(tokenizer_limit)
    return min(limits) if limits else None


def encode_texts(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Sequence[str] | Iterable[str],
    *,
    batch_size: int = 512,
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Embed texts with `model.get_text_features` in eval mode under `torch.no_grad()`.

    Texts are padded as the model's family expects (`text_padding`: per batch, or to `max_length` for SigLIP) and
    truncated to `max_length` (default: `default_max_length`, 77 for CLIP).
    Returns a float32 `[N, d]` tensor on `device` (default: the model's device), not normalised.
    """
    model = unwrap(model)
    device = torch.device(device) if device is not None else model_device(model)
    max_length = max_length if max_length is not None else default_max_length(model, tokenizer)
    padding = getattr(model, "text_padding", "longest") if max_length is not None else "longest"
    text_features: Any = model.get_text_features  # a CLIP-style model's; `nn.Module` does not declare it
    text_inputs: Any = getattr(model, "text_inputs", None)
    chunks: list[torch.Tensor] = []
    with eval_mode(model):
        for batch in _batches(texts, batch_size):
            tokens = tokenizer(
                list(batch),
                padding=padding,
                truncation=max_length is not None,
                max_length=max_length,
                return_tensors="pt",
            )
            inputs = {
                name: tokens[name].to(device) for name in ("input_ids", "attention_mask") if name in tokens
            }
            if text_inputs is not None:  # the family's convention (SigLIP: no attention mask)
                inputs = text_inputs(inputs["input_ids"], inputs.get("attention_mask"))
            chunks.append(as_embedding(text_features(**inputs)).float())
    return torch.cat(chunks) if chunks else _empty(model, device)
