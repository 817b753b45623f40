"""Compute accounting: samples seen per task and an estimate of the multiply-accumulates (MACs) they cost.

TiC-CLIP gives every strategy the same compute per time step and counts it in MACs, which for a fixed model are
proportional to samples seen (specs/ticclip.md §1.5: MACs ≈ 2.1e10 × samples for ViT-B/16). We count both:

    samples seen   = optimizer steps × global batch (exact; what the budget `samples_per_task` fixes)
    MACs estimate  = samples seen × forward MACs per sample × (3 + extra forward passes)

The forward MACs per sample are measured once per task with `torch.utils.flop_counter.FlopCounterMode` on a real
training batch (FLOPs / 2); a training step costs about 3 forward passes (forward + backward, the usual estimate);
methods that run frozen models add their forward passes (`ContinualMethod.extra_forward_passes`: LwF and Mod-X 1,
CTP 2), which is how TiC-CLIP arrives at 1.2x for LwF. With `gradient_accumulation_steps > 1` every example is
encoded once more (`hf_ccl.accumulation`: features without gradients first, then again with them): one more pass.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .accumulation import REENCODE_PASSES
from .callbacks import StreamControl, StreamState, TaskCallback
from .distributed import world_size

COMPUTE_FILE = "compute.json"
BACKWARD_FACTOR = 3.0  # forward + backward ≈ 3 forward passes


@dataclass
class TaskCompute:
    """Compute spent on one task."""

    task: str
    optimizer_steps: int
    global_batch: int
    samples_seen: int
    forward_macs_per_sample: float
    forward_passes_per_sample: float
    macs: float


def forward_macs_per_sample(model: torch.nn.Module, batch: dict[str, Any]) -> float:
    """MACs of one forward pass of `model` on `batch`, per example (measured, not modelled). A pair batch (cached
    features) counts the learner heads only: the frozen encoders ran once, when the features were cached."""
    if "features_a" in batch:
        inputs = {key: batch[key] for key in ("features_a", "features_b", "modality_a", "modality_b")}
    else:
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "pixel_values") if key in batch}
    count = len(inputs.get("pixel_values", inputs.get("features_a")))
    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            model(**inputs)
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2.0 / count


def task_compute(
    task: str, optimizer_steps: int, global_batch: int, macs_per_sample: float, extra_forward_passes: float
) -> TaskCompute:
    samples = optimizer_steps * global_batch
    passes = BACKWARD_FACTOR + extra_forward_passes
    return TaskCompute(task, optimizer_steps, global_batch, samples, macs_per_sample, passes,
                       samples * macs_per_sample * passes)


def save_compute(records: list[TaskCompute], directory: str | Path) -> None:
    payload = {
        "tasks": [asdict(record) for record in records],
        "total_samples_seen": sum(record.samples_seen for record in records),
        "total_macs": sum(record.macs for record in records),
    }
    (Path(directory) / COMPUTE_FILE).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def load_compute(directory: str | Path) -> list[TaskCompute]:
    path = Path(directory) / COMPUTE_FILE
    if not path.exists():
        return []
    try:
        return [TaskCompute(**record) for record in json.loads(path.read_text(encoding="utf-8"))["tasks"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error


def compute_summary(records: list[TaskCompute]) -> str:
    """One line per task and a total: samples seen, optimizer steps, estimated MACs."""
    lines = ["Compute per task (samples seen = optimizer steps x global batch; MACs estimated):"]
    for record in records:
        lines.append(f"  {record.task}: {record.samples_seen:,} samples ({record.optimizer_steps} steps x "
                     f"{record.global_batch}), {record.macs:.2e} MACs")
    total = sum(r.samples_seen for r in records)
    lines.append(f"  total: {total:,} samples, {sum(r.macs for r in records):.2e} MACs")
    return "\n".join(lines)


def global_batch_size(training: dict[str, Any]) -> int:
    """Examples per optimizer step over all processes."""
    per_device = int(training.get("per_device_train_batch_size", 8))
    accumulation = int(training.get("gradient_accumulation_steps", 1))
    return per_device * accumulation * world_size()


def measured_forward_macs(model: torch.nn.Module, collator: Any, dataset: Any) -> float:
    """Forward MACs per example of `model`, measured on two training examples of `dataset` (map-style or streaming);
    the collator's sampler state is restored, so measuring changes nothing."""
    state = collator.state_dict()
    rows = list(itertools.islice(iter(dataset), 2))
    batch = collator(rows)
    collator.load_state_dict(state)
    return forward_macs_per_sample(model, batch)


class ComputeCallback(TaskCallback):
    """Counts the samples and MACs of every trained task; `compute.json` in every checkpoint and the run folder."""

    def __init__(self) -> None:
        self.records: list[TaskCompute] = []
        self._macs_per_sample = 0.0

    def on_train_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self._macs_per_sample = measured_forward_macs(kwargs["learner"].model, kwargs["collator"],
                                                      kwargs["train_dataset"])

    def on_task_trained(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        trainer, methods = kwargs["trainer"], kwargs["learner"].methods
        passes = sum(method.extra_forward_passes for method in methods)
        if trainer.args.gradient_accumulation_steps > 1:
            passes += REENCODE_PASSES
        self.records.append(task_compute(kwargs["context"].task.name, trainer.state.global_step,
                                         global_batch_size(trainer.args.to_dict()), self._macs_per_sample, passes))

    def on_save(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        save_compute(self.records, kwargs["folder"])

    def on_restore(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self.records = load_compute(kwargs["folder"])
