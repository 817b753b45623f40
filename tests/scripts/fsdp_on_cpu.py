"""Run hf_ccl's CLI (`python fsdp_on_cpu.py train --config ...`, under `accelerate launch --num_processes 2`) with
FSDP2 on CPU processes (gloo): the one switch a GPU machine flips by itself is flipped here.

accelerate keeps its FSDP plugin only on GPU-like devices (`AcceleratorState` sets `DistributedType.FSDP` for
MULTI_GPU, MULTI_XPU, ..., never MULTI_CPU), and hf_ccl refuses FSDP where accelerate would drop it
(`hf_ccl.training_options.accelerate_keeps_fsdp`). This wrapper makes both say yes on CPU; everything else is the
path a GPU user runs: transformers' Trainer builds the FSDP2 plugin from `training.fsdp` / `fsdp_config` (or from
`accelerate launch --use_fsdp`), accelerate's `fsdp2_prepare_model` shards the model with `fully_shard`, the
optimizer is remapped to the shards, gradients are reduce-scattered, and hf_ccl gathers the model after each task.
What a CPU run cannot cover: NCCL collectives, GPU memory, mixed-precision policies on a GPU, CPU offload to a GPU.
"""

from __future__ import annotations

import sys

import accelerate.state
from accelerate.utils import DistributedType

import hf_ccl.training_options

_init = accelerate.state.AcceleratorState.__init__


def _keep_fsdp_plugin(self, *args, fsdp_plugin=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


def keep_fsdp_on_cpu() -> None:
    """Flip the device gate in accelerate and in hf_ccl's check (see the module docstring)."""
    accelerate.state.AcceleratorState.__init__ = _keep_fsdp_plugin
    hf_ccl.training_options.accelerate_keeps_fsdp = lambda training: True


if __name__ == "__main__":
    keep_fsdp_on_cpu()
    from hf_ccl.cli import main

    sys.exit(main(sys.argv[1:]))
