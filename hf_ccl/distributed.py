"""Small helpers for code that runs the same on one process and under `accelerate launch` / torchrun, and the
guard that several processes really train as one DDP run (`check_distributed_trainer`, `check_sharded_loader`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from transformers.training_args import ParallelMode


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


def end_process_group() -> None:
    """Destroy the process group (when one is initialised) while the interpreter is fully alive: left to interpreter
    exit, gloo's worker threads can abort the process (SIGABRT, "terminate called without an active exception")
    after a run that succeeded (pytorch/pytorch#179291)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


# ----- several processes: DDP for real ---------------------------------------------------------------------------
class NotDistributedError(ValueError):
    """Several processes were launched, but they would not train as one DDP run (each on the same batches)."""


def launched_processes() -> int:
    """Processes of this run: the process group's size once it exists, else what the launcher (torchrun,
    `accelerate launch`) put in `WORLD_SIZE`; 1 for a plain `python` process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_defaults(training: Mapping[str, Any]) -> dict[str, Any]:
    """TrainingArguments fields a launch of several processes on a machine without an accelerator needs:
    `use_cpu: true` (unless `training` sets it). `accelerate launch --multi_gpu --num_processes N` (and torchrun)
    start N processes and a process group there, but transformers makes each Trainer part of a DDP run (gloo, the
    data sharded across the processes) only with `use_cpu` or `ACCELERATE_USE_CPU`; without either every process
    trains alone on all the data."""
    if "use_cpu" in training or launched_processes() <= 1 or torch.accelerator.is_available():
        return {}
    return {"use_cpu": True}


def check_distributed_trainer(args: Any) -> None:
    """Refuse (`NotDistributedError`) TrainingArguments that would not make the launched processes one DDP run: with
    several processes, the Trainer must be distributed over all of them (else each trains on the same batches); one
    process must not drive several GPUs through nn.DataParallel (each GPU's loss over part of the batch)."""
    if args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:  # one process, several GPUs: nn.DataParallel
        raise NotDistributedError(
            f"this process sees {args.n_gpu} GPUs and was not launched as one process per GPU, so the Trainer would "
            "wrap the model in nn.DataParallel, which splits every batch across the GPUs: CLIP's contrastive loss "
            "would be computed over each GPU's part of the batch, not the whole batch. Launch one process per GPU "
            "(accelerate launch --multi_gpu, torchrun), or give the process one GPU (CUDA_VISIBLE_DEVICES=0)"
        )
    processes = launched_processes()
    if processes <= 1 or (args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size == processes):
        return
    device = torch.accelerator.current_accelerator(check_available=True)
    if device is not None:
        fix = (f"launch them on {device.type} devices that accelerate runs DDP on "
               "(accelerate launch --multi_gpu, torchrun), or run one process")
    else:  # hf_ccl sets use_cpu itself (`launch_defaults`): it was set to false
        fix = "remove training.use_cpu=false (several processes on a machine without a GPU train on the CPU, gloo)"
    raise NotDistributedError(
        f"{processes} processes were launched, but each one's Trainer is not part of a distributed run (parallel "
        f"mode {args.parallel_mode.value}, world size {args.world_size}): every process would train on the same "
        f"batches. To train as one run, {fix}"
    )


def check_sharded_loader(loader: Any, dataset: Any, processes: int | None = None) -> None:
    """Refuse (`NotDistributedError`) a training DataLoader (built from `dataset`) whose batches are not split across
    the launched processes. accelerate's loaders split them by their batch sampler (`BatchSamplerShard`), their
    dataset (`IterableDatasetShard`, or a `datasets` stream's `.shard()`), or by dispatching from the main process."""
    processes = launched_processes() if processes is None else processes
    if processes <= 1 or _shards(loader, dataset) == processes:
        return
    raise NotDistributedError(
        f"{processes} processes were launched, but the training data is not split across them (its DataLoader, "
        f"{type(loader).__name__}, gives every process the same batches): let the Trainer build and prepare the "
        "DataLoader (an overridden get_train_dataloader must pass it through accelerator.prepare)"
    )


def _shards(loader: Any, dataset: Any) -> int:
    """Processes an accelerate-prepared DataLoader splits its batches across (1 for a plain DataLoader)."""
    if type(loader).__name__ == "DataLoaderDispatcher":  # the main process reads, every process gets its slice
        return int(loader.state.num_processes)
    for part in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                 getattr(loader, "dataset", None)):
        processes = getattr(part, "num_processes", 1)
        if processes > 1:  # BatchSamplerShard, IterableDatasetShard
            return int(processes)
    inner = getattr(loader, "dataset", None)
    distributed = getattr(inner, "_distributed", None)  # datasets' split_dataset_by_node
    if distributed is not None:
        return int(distributed.world_size)
    if inner is not dataset and type(inner).__name__ == "IterableDataset" and type(dataset) is type(inner):
        return launched_processes()  # a datasets stream accelerate split with .shard(num_processes, rank)
    return 1
