"""Exact gradient accumulation for contrastive losses (open_clip's `accum_freq`, GradCache by Gao et al. 2021).

With plain gradient accumulation a contrastive loss only ever sees one micro-batch: its negatives, Mod-X's KL,
CTP's topology and DER's replay rows come from 32 examples when the user asked for 32 x 2 = 64. Here every micro-batch
(chunk) of an optimizer step is first encoded without gradients, the loss and every method term are computed once
over the whole accumulated batch with the features as leaves, and each chunk is then encoded again with gradients and
back-propagated with its share of the feature gradients. By the chain rule the sum over chunks is the gradient of the
loss over the whole batch, so one step of 32 x 2 equals one step of 64 x 1 up to float32 re-association; the cost is
one extra forward pass of the towers per chunk, the memory that of one chunk's activations.

Terms that depend on parameters directly (the temperature, EWC's penalty, a method's own parameters) get their
gradients from the whole-batch loss; under DDP they are added in the last chunk's backward (as `<p, g>`), which is
the one that synchronises, so every gradient is all-reduced exactly once.

**Randomness in the forward pass** (dropout in an adapter, a LoRA branch or a BERT-style text tower, MoE-Adapters'
noisy gating): each chunk's second, differentiable forward replays the random generators' state its no-grad forward
started from (`RNGState`, as GradCache's `RandContext`: the CPU generator and the current accelerator's), so it draws
the same masks and noise and recomputes exactly the features the loss was computed from. What is exact, then: the
gradient applied is the gradient of the loss the step computed and logged, with the random draws that step made.
What is not: 32 x 2 and 64 x 1 draw different masks and noise (in a different order, over differently shaped
tensors), so their steps are two samples of the same stochastic objective, equal in expectation, not bitwise; they
agree exactly only without randomness (tests/test_accumulation.py pins both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

Batch = dict[str, Any]
#: Forward passes per example that exact accumulation adds (each chunk is encoded once more, with gradients).
REENCODE_PASSES = 1.0
#: The projected features of one chunk: (image_features, text_features), before normalisation.
Features = tuple[torch.Tensor, torch.Tensor]


def concat_batches(chunks: Sequence[Batch]) -> Batch:
    """One batch from several collated chunks: tensors concatenated along dim 0, token-id and mask matrices of
    different lengths right-padded with 0 first (padding is masked out, and CLIP pools each row at its own EOS,
    so the padded rows encode exactly as before). Non-tensor values must agree across chunks."""
    merged: Batch = {}
    for key in chunks[0]:
        values = [chunk[key] for chunk in chunks]
        if not isinstance(values[0], torch.Tensor):
            if any(value != values[0] for value in values[1:]):
                raise ValueError(f"cannot merge micro-batches: {key!r} differs between them")
            merged[key] = values[0]
            continue
        if values[0].dim() >= 2 and not values[0].is_floating_point():
            width = max(value.shape[1] for value in values)
            values = [torch.nn.functional.pad(value, (0, width - value.shape[1])) for value in values]
        merged[key] = torch.cat(values, dim=0)
    return merged


@dataclass
class RNGState:
    """The state of the CPU generator and of the current accelerator's generators (CUDA, XPU, MPS, ...), to replay a
    chunk's forward with the same dropout masks and noise."""

    cpu: torch.Tensor
    device: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RNGState:
        module = _accelerator_module()
        if module is None:
            device = None
        elif hasattr(module, "get_rng_state_all"):
            device = list(module.get_rng_state_all())
        else:
            device = [module.get_rng_state()]
        return cls(torch.get_rng_state(), device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        module = _accelerator_module()
        if self.device is None or module is None:
            return
        if hasattr(module, "set_rng_state_all"):
            module.set_rng_state_all(self.device)
        else:
            module.set_rng_state(self.device[0])


def _accelerator_module() -> Any:
    """The device module (`torch.cuda`, `torch.xpu`, `torch.mps`, ...) of the accelerator in use, None without one
    or before it is initialised (nothing can have been drawn on it then)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return None
    module = torch.get_device_module(accelerator.type)
    is_initialized = getattr(module, "is_initialized", None)
    return None if is_initialized is not None and not is_initialized() else module


def _leaf(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The rows of every chunk as one float32 leaf that requires grad (float32: the feature gradients of a
    half-precision run must not underflow before they are scaled)."""
    return torch.cat([tensor.detach().float() for tensor in tensors]).requires_grad_(True)


def accumulated_backward(
    chunks: Sequence[Batch],
    encode: Callable[[Batch], Features],
    batch_loss: Callable[[Batch, torch.Tensor, torch.Tensor], torch.Tensor],
    parameters: Sequence[torch.nn.Parameter],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> torch.Tensor:
    """Back-propagate the loss over all `chunks` as one batch; returns that loss (detached).

    - `encode(chunk)`: the chunk's (image_features, text_features), through the (DDP-wrapped) model;
    - `batch_loss(batch, image_features, text_features)`: the total loss of the merged batch from its features
      (called once, with leaves that require grad);
    - `parameters`: every tensor that may get a gradient directly from `batch_loss` (the model's trainable
      parameters and the methods' own);
    - `backward(surrogate)`: back-propagates a scalar (the Trainer's `accelerator.backward`, which scales for fp16);
    - `no_sync()`: the context for every chunk but the last (DDP's `no_sync`).
    """
    states, images, texts = [], [], []
    with torch.no_grad():
        for chunk in chunks:
            states.append(RNGState.capture())
            image, text = encode(chunk)
            images.append(image)
            texts.append(text)
    sizes = [image.shape[0] for image in images]
    image_leaf, text_leaf = _leaf(images), _leaf(texts)
    loss = batch_loss(concat_batches(chunks), image_leaf, text_leaf)
    trainable = [p for p in parameters if p.requires_grad]
    grads = torch.autograd.grad(loss, [image_leaf, text_leaf, *trainable], allow_unused=True)
    after_loss = RNGState.capture()
    image_grad = _or_zeros(grads[0], image_leaf).split(sizes)
    text_grad = _or_zeros(grads[1], text_leaf).split(sizes)
    direct = [(p, g) for p, g in zip(trainable, grads[2:], strict=True) if g is not None]
    for index, chunk in enumerate(chunks):
        last = index == len(chunks) - 1
        with nullcontext() if last else no_sync():
            states[index].restore()
            image, text = encode(chunk)
            surrogate = _dot(image, image_grad[index]) + _dot(text, text_grad[index])
            if last:
                for parameter, grad in direct:
                    surrogate = surrogate + _dot(parameter, grad)
            if surrogate.requires_grad:
                backward(surrogate)
    after_loss.restore()  # later draws continue from where the whole-batch loss left the generators
    return loss.detach()


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _dot(tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """<tensor, grad> in float32: its gradient with respect to `tensor` is exactly `grad`."""
    return (tensor.float() * grad.to(tensor.device)).sum()
