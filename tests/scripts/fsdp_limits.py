"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_fsdp.py: the smallest
checks of the limits FSDP meets on this stack (what `hf_ccl.sharding` works around and `check_fsdp` refuses).

1. torch's FSDP2 (`fully_shard`) itself runs on CPU with gloo: a two-layer MLP shards (DTensor parameters), trains
   one step and gathers a full state dict on rank 0.
2. `fully_shard` refuses every CLIP: `logit_scale` is a scalar (0-d) parameter.
3. accelerate drops its FSDP plugin on CPU: an `Accelerator(fsdp_plugin=...)` there is plain multi-CPU (DDP).
4. accelerate's FSDP1 plugin cannot even be built without a GPU (`sync_module_states`, transformers' default).
Writes `rank<r>.json` into the folder given as the first argument.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from hf_ccl.testing import tiny_clip


def mlp_shards() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"mlp_dtensor": isinstance(model[0].weight, DTensor), "mlp_local_rows": model[0].weight.to_local().shape[0],
            "mlp_full_keys": sorted(full)}


def clip_refused() -> str:
    try:
        fully_shard(tiny_clip(seed=0))
    except ValueError as error:
        return str(error)
    return ""


def accelerate_plugin() -> dict:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    state = accelerator.state
    try:
        FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=True)
        fsdp1_error = ""
    except RuntimeError as error:
        fsdp1_error = str(error)
    return {"distributed_type": str(state.distributed_type), "fsdp_plugin_kept": getattr(state, "fsdp_plugin", None) is not None,
            "fsdp1_error": fsdp1_error}


def main() -> None:
    output_dir = Path(sys.argv[1])
    state = PartialState(cpu=True)
    report = {"world_size": dist.get_world_size(), "torch": torch.__version__, "accelerate": accelerate.__version__,
              "transformers": transformers.__version__, **mlp_shards(), "clip_error": clip_refused(),
              **accelerate_plugin()}
    (output_dir / f"rank{state.process_index}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
