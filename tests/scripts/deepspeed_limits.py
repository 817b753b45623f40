"""Run under `accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2` (gloo, CPU) by tests/test_deepspeed.py:
the smallest checks of why DeepSpeed cannot train an hf_ccl run on this stack (what `training.deepspeed` and
`ACCELERATE_USE_DEEPSPEED` are refused with, `hf_ccl.training_options.DEEPSPEED_LIMITS`).

1. DeepSpeed itself runs on CPU with gloo: accelerate builds its DeepSpeed engine around a SigLIP (whose
   `logit_scale` has shape `(1,)`) at the launcher's ZeRO stage.
2. Its engine refuses every CLIP: broadcasting the 0-d `logit_scale` fails (`p.data.view(torch.uint8)`).
3. `accelerator.backward` also steps the optimizer, so nothing between backward and `optimizer.step()` (the
   Trainer's `on_pre_optimizer_step`, where the methods edit gradients) sees this step's gradients, and ZeRO-2 leaves
   no `.grad` on the parameters.
4. On a CPU, accelerate's state under DeepSpeed counts one process (world size 1, process index 0 on every rank),
   so the DeepSpeed batch size it derives is wrong unless set (the Trainer's `use_cpu`, which hf_ccl sets, avoids it).
5. ZeRO-3 partitions every parameter: outside a forward pass a rank holds an empty tensor, and so does a deep copy
   (what a teacher, momentum model or anchor would be).
Writes `rank<r>.json` into the folder given as the first argument.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import accelerate
import deepspeed
import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator

from hf_ccl.testing import tiny_model

SIZES = {"hidden_size": 32, "num_layers": 1}


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    """A loss through both towers of a tiny dual encoder."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    pixels = torch.randn(2, 3, 32, 32, generator=generator)
    ids = torch.randint(0, 1000, (2, 8), generator=generator)
    return model(input_ids=ids, pixel_values=pixels).logits_per_image.square().mean()


def engine_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}


def clip_refused() -> str:
    """DeepSpeed's engine around a CLIP (0-d logit_scale), ZeRO-1: the error, or "" if it builds."""
    model = tiny_model("clip", **SIZES)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=engine_config(1))
    except RuntimeError as error:
        return str(error)
    return ""


def step_in_backward(accelerator: Accelerator) -> dict:
    """Does `accelerator.backward` change the parameters (the optimizer step) and leave `.grad`s behind?"""
    model = tiny_model("siglip", **SIZES)
    accelerator.state.deepspeed_plugin.deepspeed_config.update(  # no DataLoader to read the batch size from
        train_micro_batch_size_per_gpu=2, train_batch_size=2 * dist.get_world_size())
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    params = [p for p in accelerator.unwrap_model(model).parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    accelerator.backward(loss_of(model))
    changed = sum(not torch.equal(b, p.detach()) for b, p in zip(before, params, strict=True))
    return {"engine": type(model).__name__, "params_changed_by_backward": changed, "params": len(params),
            "grads_after_backward": sum(p.grad is not None for p in params)}


def zero3_partitions() -> dict:
    """ZeRO-3's parameters outside forward, and a deep copy of the partitioned model."""
    model = tiny_model("siglip", **SIZES)
    full = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=engine_config(3))
    local = sum(p.numel() for p in engine.module.parameters())
    try:
        copied = sum(p.numel() for p in copy.deepcopy(engine.module).parameters())
        copy_error = ""
    except Exception as error:  # noqa: BLE001 (recorded: what a teacher copy would meet)
        copied, copy_error = -1, f"{type(error).__name__}: {error}"
    return {"zero3_full_numel": full, "zero3_local_numel": local, "zero3_copy_numel": copied,
            "zero3_copy_error": copy_error}


def main() -> None:
    output_dir = Path(sys.argv[1])
    accelerator = Accelerator()  # the launcher's DeepSpeed plugin (cpu=True would drop it)
    report = {"world_size": dist.get_world_size(), "deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "accelerate": accelerate.__version__, "transformers": transformers.__version__,
              "distributed_type": str(accelerator.state.distributed_type),
              "zero_stage": accelerator.state.deepspeed_plugin.zero_stage,
              "accelerate_num_processes": accelerator.num_processes,
              "clip_error": clip_refused(), **step_in_backward(accelerator), **zero3_partitions()}
    (output_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
