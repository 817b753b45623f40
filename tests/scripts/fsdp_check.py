"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_fsdp.py, once with FSDP2
(`fsdp`) and once without (`ddp`): the same tiny continual runs, whose per-step losses, final weights and method
state the test compares across the two launches.

Arguments: the output folder, `fsdp` or `ddp`, and the runs as `family:method[+method]` separated by commas. Each
run trains 2 tasks x 2 steps with plain SGD and no warm-up (AdamW would turn float-rounding differences of
near-zero gradients into whole learning-rate steps; a warm-up step of rate 0 would leave a penalty at 0) and writes, on rank 0, `<run>.safetensors` (the model after the last task, then
`method/<name>/<path>` for every tensor of every method's state) and `<run>.json` (each step's loss, the model's
class, and whether the Trainer was sharded). FSDP2 runs on CPU through `fsdp_on_cpu.keep_fsdp_on_cpu` (see there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors.torch import save_file
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the method matrix
sys.path.insert(0, str(Path(__file__).resolve().parent))
import method_matrix  # noqa: E402
from fsdp_on_cpu import keep_fsdp_on_cpu  # noqa: E402
from method_matrix import LogRecorder, flat_state, run_method  # noqa: E402

#: Penalty strengths large enough that the penalty moves the weights in the second task's 2 steps (at the tests'
#: defaults it stays below float32 resolution there), so that a wrong sharded penalty gradient shows.
STRONGER = {"ewc": {"ewc_lambda": 1e6}, "mas": {"mas_lambda": 1e6}}


class Sharded(TrainerCallback):
    """Whether each task's Trainer trained a sharded model."""

    def __init__(self) -> None:
        self.sharded: list[bool] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        from hf_ccl.sharding import is_sharded

        self.sharded.append(is_sharded(model))


def main() -> None:
    output_dir, mode, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    if mode == "fsdp":
        keep_fsdp_on_cpu()
    state = PartialState(cpu=True)
    for name, options in STRONGER.items():
        method_matrix.METHOD_ARGS[name] = {**method_matrix.METHOD_ARGS.get(name, {}), **options}
    for run in runs:
        family, _, names = run.partition(":")
        methods = names.split("+")
        log, sharded = LogRecorder(), Sharded()
        training = {"optim": "sgd", "learning_rate": 0.05, "warmup_steps": 0, "per_device_train_batch_size": 8,
                    **({"fsdp": True} if mode == "fsdp" else {})}
        learner = run_method(methods, output_dir / mode / run.replace(":", "_"), training, family=family,
                             callbacks=[log, sharded], save_checkpoints=True,  # a budget of 2 steps per task
                             samples_per_task=2 * 8 * state.num_processes)
        if state.is_main_process:
            tensors = {name: value.detach().cpu().contiguous() for name, value in learner.model.state_dict().items()}
            for method in learner.methods:
                for path, value in flat_state(method.state_dict()).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"method/{method.name}/{path}"] = value.detach().cpu().contiguous()
            key = run.replace(":", "_")
            save_file(tensors, output_dir / f"{mode}-{key}.safetensors")
            report = {"losses": [[task, logs["loss"]] for task, logs in log.logs if "loss" in logs],
                      "terms": [[task, {k: v for k, v in logs.items() if k.startswith("loss/")}]
                                for task, logs in log.logs if "loss" in logs],
                      "model_class": type(learner.model).__name__, "sharded": sharded.sharded,
                      "checkpoint": str(output_dir / mode / key / "task-1")}
            (output_dir / f"{mode}-{key}.json").write_text(json.dumps(report))
        state.wait_for_everyone()


if __name__ == "__main__":
    main()
