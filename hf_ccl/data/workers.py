"""How many DataLoader worker processes a run uses by default: enough to feed a GPU, none on a CPU.

On a GPU the model's step runs on the device while image decoding and preprocessing (`CLIPCollator`) run on the
CPU: with `dataloader_num_workers: 0` the GPU waits for the main process to prepare every batch. On a CPU the
workers would compete with the training step for the same cores, so the default there is 0.
"""

from __future__ import annotations

import os
from typing import Any

#: At most this many workers per process by default (more rarely helps and costs memory per worker).
MAX_DEFAULT_WORKERS = 8


def usable_cores() -> int:
    """CPU cores this process may run on (`os.sched_getaffinity`, which honours taskset/cgroup pinning; else
    `os.cpu_count()`)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def local_process_count() -> int:
    """Training processes on this machine: `LOCAL_WORLD_SIZE` (set by torchrun and `accelerate launch`), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_num_workers(device_type: str, cores: int, local_processes: int = 1,
                        cap: int = MAX_DEFAULT_WORKERS) -> int:
    """DataLoader workers per process: 0 unless `device_type` is `"cuda"`; there, the process's share of the
    `cores` (`cores // local_processes`) less one core for the process itself, between 0 and `cap`."""
    if cores < 1 or local_processes < 1 or cap < 0:
        raise ValueError(f"cores and local_processes must be >= 1 and cap >= 0, got {cores}, {local_processes}, {cap}")
    if device_type != "cuda":
        return 0
    return max(0, min(cap, cores // local_processes - 1))


def dataloader_defaults(training: dict[str, Any], device_type: str, cores: int | None = None,
                        local_processes: int | None = None) -> dict[str, Any]:
    """The DataLoader settings a task trains with when `training` (the user's section) does not set
    `dataloader_num_workers`: workers by `default_num_workers`, kept alive across the task's epochs
    (`dataloader_persistent_workers`, so each worker's caption sampler continues rather than restarts every
    epoch). With the user's own worker count, nothing is added."""
    if "dataloader_num_workers" in training:
        return {}
    workers = default_num_workers(device_type, usable_cores() if cores is None else cores,
                                  local_process_count() if local_processes is None else local_processes)
    values: dict[str, Any] = {"dataloader_num_workers": workers}
    if workers > 0 and "dataloader_persistent_workers" not in training:
        values["dataloader_persistent_workers"] = True
    return values


def training_device_type(training: dict[str, Any]) -> str:
    """`"cuda"` when a task of this `training` section trains on a GPU (one is visible and `use_cpu` is not set),
    else `"cpu"` (other accelerators get the CPU rule: no default workers)."""
    import torch

    return "cuda" if torch.cuda.is_available() and not training.get("use_cpu") else "cpu"
