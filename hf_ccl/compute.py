"""What each task of a run costs: samples seen, an estimate of the multiply-accumulates (MACs), wall time by phase,
peak memory, trainable parameters and the size of the methods' state.

TiC-CLIP gives every strategy the same compute per time step and counts it in MACs, which for a fixed model are
proportional to samples seen (specs/ticclip.md §1.5: MACs ≈ 2.1e10 × samples for ViT-B/16). We count both:

    samples seen   = optimizer steps × global batch (exact; what the budget `samples_per_task` fixes)
    MACs estimate  = samples seen × forward MACs per sample × (3 + extra forward passes)
                     + optimizer steps × step MACs (class prompts, reference batches: measured per task)

The forward MACs per sample are measured once per task with `torch.utils.flop_counter.FlopCounterMode` on a real
training batch (FLOPs / 2); a training step costs about 3 forward passes (forward + backward, the usual estimate);
methods that run frozen models add their forward passes (`ContinualMethod.extra_forward_passes`: LwF and Mod-X 1,
CTP 2), which is how TiC-CLIP arrives at 1.2x for LwF. With `gradient_accumulation_steps > 1` every example is
encoded once more (`hf_ccl.accumulation`: features without gradients first, then again with them): one more pass.

Besides compute, every task records (`TaskCompute`, written to `compute.json`, the `cost` section of `results.json`,
the printed summary and the model card):

    seconds              wall time by phase, timed by the loop (`phase_timer`): `task_start` (the methods'
                         task-start hooks: teacher copies, adapters), `setup` (datasets, collators, the MAC count),
                         `train` (`Trainer.train`), `after_training` and `task_end` (the methods' work after the
                         steps: Fisher, covariances, caches, buffers, weight patching), `eval` (the results-matrix
                         row), `checkpoint` (writing task-<k>/; recorded once written, so the task's own checkpoint
                         lacks it)
    peak_rss_bytes       peak resident memory of the (main) process during the task: VmHWM, reset at the task's
                         start through /proc/self/clear_refs (Linux); elsewhere the process's peak so far
    peak_cuda_bytes      peak memory allocated by torch on the current CUDA device during the task (None on CPU)
    trainable_parameters parameters the optimizer updates (the model's trainable ones and the methods' own)
    method_state_bytes   per method: bytes of its state as saved in a checkpoint (tensors and JSON), after the task
"""

from __future__ import annotations

import contextlib
import itertools
import json
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from .accumulation import REENCODE_PASSES
from .callbacks import StreamControl, StreamState, TaskCallback
from .distributed import world_size
from .files import write_text_atomic

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
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int | None = None
    peak_cuda_bytes: int | None = None
    trainable_parameters: int | None = None
    total_parameters: int | None = None
    method_state_bytes: dict[str, int] = field(default_factory=dict)
    #: MACs of every optimizer step besides its examples' passes (included in `macs`): the class prompts of the
    #: cross-entropy loss, the methods' reference batches (`ContinualMethod.step_macs`).
    step_macs: float = 0.0

    @property
    def wall_seconds(self) -> float:
        """Wall time of the task over all timed phases."""
        return sum(self.seconds.values())

    @property
    def method_seconds(self) -> float:
        """The methods' own work outside the training steps (task start, after training, task end)."""
        return sum(self.seconds.get(phase, 0.0) for phase in METHOD_PHASES)


#: Phases the loop times; `METHOD_PHASES` are the methods' work outside the training steps.
PHASES = ("task_start", "setup", "train", "after_training", "eval", "task_end", "checkpoint")
METHOD_PHASES = ("task_start", "after_training", "task_end")


@contextlib.contextmanager
def phase_timer(seconds: dict[str, float], phase: str) -> Iterator[None]:
    """Add the wall time of the block to `seconds[phase]` (also when it raises)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_memory() -> None:
    """Start a new peak-memory window: the process's peak RSS (Linux) and torch's CUDA peak statistics."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def peak_memory() -> tuple[int | None, int | None]:
    """(peak RSS bytes since `reset_peak_memory`, peak CUDA bytes allocated since then or None without CUDA)."""
    rss = None
    with contextlib.suppress(OSError, ValueError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) * 1024
    if rss is None:  # no /proc: the process's peak since it started (ru_maxrss: KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = peak if sys.platform == "darwin" else peak * 1024
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = int(torch.cuda.max_memory_allocated())
    return rss, cuda


def trainable_parameter_count(model: torch.nn.Module, methods: Any = ()) -> tuple[int, int]:
    """(parameters the optimizer updates, all parameters): the model's and the methods' `optimizer_parameters`."""
    extra = [p for method in methods for p in method.optimizer_parameters()]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable += sum(p.numel() for p in extra if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in extra)


def state_bytes(state: Any) -> int:
    """Bytes a method's `state_dict()` takes in a checkpoint: its tensors' data plus the JSON of the rest."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) + len(str(key)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return len(json.dumps(state, default=str))


def forward_macs_per_sample(model: torch.nn.Module, batch: dict[str, Any]) -> float:
    """MACs of one forward pass of `model` on `batch`, per example (measured, not modelled). A pair batch (cached
    features) counts the learner heads only: the frozen encoders ran once, when the features were cached."""
    if "features_a" in batch:
        inputs = {key: batch[key] for key in ("features_a", "features_b", "modality_a", "modality_b")}
    else:
        names = ("input_ids", "attention_mask", *getattr(model, "image_input_names", ("pixel_values",)))
        inputs = {key: batch[key] for key in names if key in batch}
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
    task: str, optimizer_steps: int, global_batch: int, macs_per_sample: float, extra_forward_passes: float,
    step_macs: float = 0.0,
) -> TaskCompute:
    samples = optimizer_steps * global_batch
    passes = BACKWARD_FACTOR + extra_forward_passes
    return TaskCompute(task, optimizer_steps, global_batch, samples, macs_per_sample, passes,
                       samples * macs_per_sample * passes + optimizer_steps * step_macs, step_macs=step_macs)


def class_prompt_step_macs(model: torch.nn.Module, prompts: Any) -> float:
    """MACs one optimizer step spends on the cross-entropy's class prompts (`hf_ccl.class_prompts`): their text
    forward pass, measured, times `BACKWARD_FACTOR` (they are encoded with gradients)."""
    counter = FlopCounterMode(display=False)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), counter:
            model.embed_texts(prompts.input_ids.to(device), prompts.attention_mask.to(device))
    finally:
        model.train(was_training)
    return counter.get_total_flops() / 2.0 * BACKWARD_FACTOR


def save_compute(records: list[TaskCompute], directory: str | Path) -> None:
    tasks = [asdict(record) for record in records]
    payload = {"tasks": tasks, **cost_totals(tasks)}
    write_text_atomic(Path(directory) / COMPUTE_FILE, json.dumps(payload, indent=2) + "\n")


def cost_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's totals of per-task cost records (as dicts): wall seconds by phase, the evaluation's share, the
    largest peak memory and trainable-parameter count, samples and MACs."""
    seconds = {phase: sum(record.get("seconds", {}).get(phase, 0.0) for record in records) for phase in PHASES}
    wall = sum(seconds.values())

    def largest(key: str) -> int | None:
        values = [record[key] for record in records if record.get(key) is not None]
        return max(values) if values else None

    return {
        "total_seconds": seconds,
        "total_wall_seconds": wall,
        "eval_share": seconds["eval"] / wall if wall else None,
        "max_peak_rss_bytes": largest("peak_rss_bytes"),
        "max_peak_cuda_bytes": largest("peak_cuda_bytes"),
        "max_trainable_parameters": largest("trainable_parameters"),
        "final_method_state_bytes": sum(records[-1].get("method_state_bytes", {}).values()) if records else 0,
        "total_samples_seen": sum(record.get("samples_seen", 0) for record in records),
        "total_macs": sum(record.get("macs", 0.0) for record in records),
    }


#: Columns of the cost part of a table over runs (the all-methods benchmarks), filled by `run_cost_cells`.
RUN_COST_HEADER = ("wall (s)", "train (s)", "eval (s)", "methods (s)", "peak memory", "trainable", "method state",
                   "samples", "MACs")
RUN_COST_NOTE = ("Cost columns (`hf_ccl.compute`, mean over seeds): wall = all timed phases of the run; methods = the "
                 "methods' task-start, after-training and task-end work; peak memory = the largest per-task peak: "
                 "allocated CUDA memory on a GPU, else the RSS of the benchmark's process (one process runs every "
                 "configuration, so it includes what the process already held); trainable = the most parameters the "
                 "optimizer updated in any task; method state = bytes of the methods' checkpointed state after the "
                 "last task; samples and MACs = the training work.")


def run_cost(records: list[TaskCompute]) -> dict[str, float | None]:
    """One run's cost as flat numbers (for tables over runs): `cost_totals` of the loop's records, by key."""
    totals = cost_totals([asdict(record) for record in records])
    seconds = totals["total_seconds"]
    return {
        "wall_s": totals["total_wall_seconds"], "train_s": seconds["train"], "eval_s": seconds["eval"],
        "methods_s": sum(seconds[phase] for phase in METHOD_PHASES), "peak_rss_bytes": totals["max_peak_rss_bytes"],
        "peak_cuda_bytes": totals["max_peak_cuda_bytes"], "trainable_parameters": totals["max_trainable_parameters"],
        "method_state_bytes": totals["final_method_state_bytes"], "samples": totals["total_samples_seen"],
        "macs": totals["total_macs"],
    }


def mean_run_cost(costs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Key-wise mean of `run_cost` dicts (over seeds); None where no run recorded the key."""
    mean: dict[str, float | None] = {}
    for key in costs[0]:
        values = [cost[key] for cost in costs if cost.get(key) is not None]
        mean[key] = sum(values) / len(values) if values else None
    return mean


def run_cost_cells(cost: dict[str, float | None]) -> str:
    """The `RUN_COST_HEADER` cells of one table row, joined by ` | ` (peak CUDA replaces peak RSS where recorded)."""
    peak = cost.get("peak_cuda_bytes") or cost.get("peak_rss_bytes")
    cells = [f"{cost[key]:.1f}" for key in ("wall_s", "train_s", "eval_s", "methods_s")]
    cells += [format_bytes(peak) if peak is not None else "-",
              format_count(int(cost["trainable_parameters"])) if cost.get("trainable_parameters") is not None else "-",
              format_bytes(cost["method_state_bytes"] or 0), f"{cost['samples']:,.0f}", f"{cost['macs']:.2e}"]
    return " | ".join(cells)


def load_compute(directory: str | Path) -> list[TaskCompute]:
    path = Path(directory) / COMPUTE_FILE
    if not path.exists():
        return []
    try:
        return [TaskCompute(**record) for record in json.loads(path.read_text(encoding="utf-8"))["tasks"]]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error


def compute_summary(records: list[TaskCompute]) -> str:
    """One line per task and a total: samples seen, optimizer steps, estimated MACs, then the wall time by phase,
    peak memory, trainable parameters and method state where recorded."""
    lines = ["Compute per task (samples seen = optimizer steps x global batch; MACs estimated):"]
    for record in records:
        lines.append(f"  {record.task}: {record.samples_seen:,} samples ({record.optimizer_steps} steps x "
                     f"{record.global_batch}), {record.macs:.2e} MACs")
    total = sum(r.samples_seen for r in records)
    lines.append(f"  total: {total:,} samples, {sum(r.macs for r in records):.2e} MACs")
    timed = [record for record in records if record.seconds]
    if timed:
        lines.append("Cost per task (wall seconds: train / eval / methods / other; peak memory; trainable "
                     "parameters; method state):")
        for record in timed:
            lines.append(f"  {record.task}: {cost_line(record)}")
        wall = sum(r.wall_seconds for r in timed)
        evaluation = sum(r.seconds.get("eval", 0.0) for r in timed)
        lines.append(f"  total: {wall:.1f} s, of which training {sum(r.seconds.get('train', 0.0) for r in timed):.1f} s"
                     f", evaluation {evaluation:.1f} s ({100 * evaluation / wall if wall else 0:.0f}%), methods "
                     f"{sum(r.method_seconds for r in timed):.1f} s")
    return "\n".join(lines)


def cost_line(record: TaskCompute) -> str:
    """`12.3 s (train 10.1 / eval 1.2 / methods 0.4 / other 0.6), peak RSS 1.2 GiB, 3.4M trainable, state 1.0 MiB`."""
    train, evaluation = record.seconds.get("train", 0.0), record.seconds.get("eval", 0.0)
    other = record.wall_seconds - train - evaluation - record.method_seconds
    parts = [f"{record.wall_seconds:.1f} s (train {train:.1f} / eval {evaluation:.1f} / methods "
             f"{record.method_seconds:.1f} / other {other:.1f})"]
    if record.peak_rss_bytes is not None:
        parts.append(f"peak RSS {format_bytes(record.peak_rss_bytes)}")
    if record.peak_cuda_bytes is not None:
        parts.append(f"peak CUDA {format_bytes(record.peak_cuda_bytes)}")
    if record.trainable_parameters is not None:
        parts.append(f"{format_count(record.trainable_parameters)} trainable")
    parts.append(f"method state {format_bytes(sum(record.method_state_bytes.values()))}")
    return ", ".join(parts)


def cost_table(records: list[TaskCompute]) -> list[str]:
    """Markdown table of what each task cost, one row per task and a total row (empty without timed records)."""
    timed = [record for record in records if record.seconds]
    if not timed:
        return []
    lines = ["| task | wall (s) | train (s) | eval (s) | methods (s) | checkpoint (s) | peak RSS | peak CUDA | "
             "trainable params | method state | samples | MACs |", "|---" * 12 + "|"]

    def row(label: str, rs: list[TaskCompute]) -> str:
        seconds = {phase: sum(r.seconds.get(phase, 0.0) for r in rs) for phase in PHASES}
        rss = [r.peak_rss_bytes for r in rs if r.peak_rss_bytes is not None]
        cuda = [r.peak_cuda_bytes for r in rs if r.peak_cuda_bytes is not None]
        state = rs[-1].method_state_bytes
        checkpoint = f"{seconds['checkpoint']:.2f}" if any("checkpoint" in r.seconds for r in rs) else "-"
        return (f"| {label} | {sum(seconds.values()):.2f} | {seconds['train']:.2f} | {seconds['eval']:.2f} | "
                f"{sum(seconds[p] for p in METHOD_PHASES):.2f} | {checkpoint} | "
                f"{format_bytes(max(rss)) if rss else '-'} | {format_bytes(max(cuda)) if cuda else '-'} | "
                f"{format_count(max(r.trainable_parameters or 0 for r in rs))} | "
                f"{format_bytes(sum(state.values()))} | {sum(r.samples_seen for r in rs):,} | "
                f"{sum(r.macs for r in rs):.2e} |")

    lines += [row(record.task, [record]) for record in timed]
    lines.append(row("**total**", timed))
    lines += ["", "Wall time by phase: train = `Trainer.train`; methods = their task-start, after-training and task-end "
              "work (teachers, Fisher, buffers, patching); checkpoint = writing task-<k>/ (missing for a task in its own "
              "checkpoint). Peak memory: of the main process during the task; total row: the largest. Trainable "
              "params: total row = the most in any task. Method state: bytes of all methods' state in the checkpoint "
              "(total row: after the last task)."]
    return lines


def format_bytes(value: float) -> str:
    """Bytes in binary units: `512 B`, `3.2 KiB`, `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(value: int) -> str:
    """A parameter count: `950`, `12.3K`, `3.4M`, `1.2B`."""
    for divisor, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= divisor:
            return f"{value / divisor:.1f}{suffix}"
    return str(value)


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
    """Records what every trained task cost (`TaskCompute`): `compute.json` in every checkpoint and the run folder,
    and the `cost` section of the results."""

    def __init__(self) -> None:
        self.records: list[TaskCompute] = []
        self._macs_per_sample = 0.0
        self._step_macs = 0.0
        self._parameters: tuple[int, int] = (0, 0)

    def on_task_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        reset_peak_memory()

    def on_train_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        learner = kwargs["learner"]
        self._macs_per_sample = measured_forward_macs(learner.model, kwargs["collator"], kwargs["train_dataset"])
        self._parameters = trainable_parameter_count(learner.model, learner.methods)
        context = kwargs["context"]
        self._step_macs = sum(method.step_macs(learner.model, context) for method in learner.methods)
        if context.class_prompts is not None:
            self._step_macs += class_prompt_step_macs(learner.model, context.class_prompts)
        self._step_macs *= world_size()  # every process encodes the prompts and its (same) reference batch

    def on_task_trained(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        trainer, methods = kwargs["trainer"], kwargs["learner"].methods
        passes = sum(method.extra_forward_passes for method in methods)
        if trainer.args.gradient_accumulation_steps > 1:
            passes += REENCODE_PASSES
        record = task_compute(kwargs["context"].task.name, trainer.state.global_step,
                              global_batch_size(trainer.args.to_dict()), self._macs_per_sample, passes,
                              self._step_macs)
        record.trainable_parameters, record.total_parameters = self._parameters
        record.seconds = kwargs["context"].phase_seconds  # the loop's clock: later phases land here too
        self.records.append(record)

    def on_task_end(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        learner, record = kwargs["learner"], self.records[-1]
        record.peak_rss_bytes, record.peak_cuda_bytes = peak_memory()
        record.method_state_bytes = {method.name: state_bytes(method.state_dict()) for method in learner.methods}
        learner.results.cost = [asdict(record) for record in self.records]

    def on_checkpoint_saved(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        kwargs["learner"].results.cost = [asdict(record) for record in self.records]  # with the checkpoint's time

    def on_save(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        save_compute(self.records, kwargs["folder"])

    def on_restore(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self.records = load_compute(kwargs["folder"])
        kwargs["learner"].results.cost = [asdict(record) for record in self.records]
