"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_gem.py.

GEM and A-GEM each on 2 conflicting tiny digits tasks (`conflicting_stream`) x 8 SGD steps: every process computes
the memory gradients itself (no communication) from the same memory, parameters and all-reduced gradient, so both
ranks must end with bit-identical parameters and memories. Writes `rank<r>.json` (per method: a SHA-256 of every parameter, the memory rows, how many
steps projected) into the folder given as the first argument.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data.builders import quiet_progress_bars
from hf_ccl.data.collate import load_image_processor, load_tokenizer
from hf_ccl.data.named import build_stream
from hf_ccl.data.task import TaskStream
from hf_ccl.distributed import world_size
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import tiny_clip

OPTIONS = {"gem": {"memory_per_task": 16}, "agem": {"memory_per_task": 16, "reference_batch_size": 8}}
STEPS, BATCH = 8, 8
SGD = {"optim": "sgd", "learning_rate": 0.05, "weight_decay": 0.0, "lr_scheduler_type": "constant"}


class ProjectedSteps(TrainerCallback):
    """Counts the optimizer steps at which the method projected (its `projected` metric, read right after its
    `pre_optimizer_step`)."""

    def __init__(self, method: ContinualMethod) -> None:
        self.method, self.count = method, 0

    def on_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.count += int(self.method.metrics().get("projected", 0.0) > 0)


def conflicting_stream(train_rows: int = 68, eval_rows: int = 8) -> TaskStream:
    """Two tiny digits tasks that conflict: {0, 1}, then the same images with the captions swapped ("zero" <-> "one").
    The second task's gradient opposes the first task's memory gradient at most steps, so the projections engage
    (digits {2, 3} mostly agree with {0, 1} on a tiny CLIP: they would project at a step or two at most)."""
    stream = build_stream("digits", max_train_per_task=train_rows, max_eval_per_task=eval_rows)
    first = stream.tasks[0]
    swap = {"zero": "one", "one": "zero"}

    def relabel(row: dict) -> dict:
        return {"texts": [re.sub(r"\b(zero|one)\b", lambda m: swap[m.group(1)], text) for text in row["texts"]]}

    with quiet_progress_bars():
        train = first.train.map(relabel)
    stream.tasks = [first, dataclasses.replace(first, name="digits-0-1-swapped", train=train,
                                               class_names=[swap[name] for name in first.class_names or []])]
    return stream


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's name and bytes, in order."""
    sha = hashlib.sha256()
    for name, param in model.named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def run(name: str, output_dir: Path) -> dict:
    stream = conflicting_stream(64)
    args = ContinualArguments(
        output_dir=str(output_dir / name),
        training={"per_device_train_batch_size": BATCH, "logging_steps": 100, **SGD},
        samples_per_task=STEPS * BATCH * world_size(),
        progress=False, evaluation={"initial": False}, save_checkpoints=False, seed=1,
    )
    methods = build_methods([name], {name: OPTIONS[name]})
    counter = ProjectedSteps(methods[0])
    learner = ContinualLearner(tiny_clip(seed=1), stream, methods, load_image_processor(32), load_tokenizer(), args,
                               callbacks=[counter])
    learner.fit()
    return {
        "world_size": world_size(),
        "parameters": digest(learner.model),
        "memories": [[m.task_index, m.rows] for m in methods[0].memories],
        "projected_steps": counter.count,
    }


def main() -> None:
    output_dir = Path(sys.argv[1])
    rank = PartialState(cpu=True).process_index
    report = {name: run(name, output_dir) for name in OPTIONS}
    (output_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
