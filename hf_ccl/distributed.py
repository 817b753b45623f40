"""Small helpers for code that runs the same on one process and under `accelerate launch` / torchrun."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


def is_distributed() -> bool:
    """True when a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank; before the process group exists, the launcher's `RANK` (accelerate launch, torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main_process() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def broadcast_object(value: object) -> object:
    """The main process's `value` on every process (as is when not distributed)."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate `tensor` from every process along dim 0, keeping gradients (identity on one process).

    `torch.distributed.nn.functional.all_gather` sums the incoming gradients over processes in backward, so a
    loss computed identically on every rank over the gathered batch gives, after DDP's gradient averaging,
    exactly the gradient of that global loss (the open_clip `gather_with_grad` argument).
    """
    if not is_distributed():
        return tensor
    return torch.cat(dist_fn.all_gather(tensor.contiguous()), dim=0)


def all_gather_no_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate `tensor` from every process along dim 0, without gradients (identity on one process)."""
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over processes in place (no-op on one process); returns it."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
