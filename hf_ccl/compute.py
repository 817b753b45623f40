"""What a run costs: per task the samples seen, the multiply-accumulates (MACs) of its training steps, wall time by
phase, peak memory, trainable parameters and the size of the methods' state; per run the start-up and the initial
evaluation.

TiC-CLIP gives every strategy the same compute per time step and counts it in MACs, which for a fixed model are
proportional to samples seen (specs/ticclip.md §1.5: MACs ≈ 2.1e10 × samples for ViT-B/16). Both are counted from
what was trained (`StepMeter`, on every process, summed over processes):

    samples seen   the rows of every training batch, partial batches as they are (the last one of an epoch, the
                   padding accelerate adds so that every process gets a batch); with `samples_per_task` every batch is
                   whole, so samples seen = optimizer steps x global batch = the budget
    MACs           every optimizer step is keyed by the shapes of its micro-batches; the first step of each shape runs
                   under `torch.utils.flop_counter.FlopCounterMode` (FLOPs / 2) from its forward to the methods'
                   post-step hooks: forward and backward, the methods' terms (teachers, momentum models, reference
                   batches, class prompts, GEM's memory), exact accumulation's second pass. Every step of that shape
                   counts what its first one measured. (A method that caches work, e.g. `teacher_cache`, does less on
                   later steps: for it the count is an upper bound.) Records of older versions hold an estimate
                   (samples x forward MACs x passes), marked `macs_measured: false`.

Besides compute, every task records (`TaskCompute`, written to `compute.json`, the `cost` section of `results.json`,
the printed summary and the model card):

    seconds              wall time by phase, timed by the loop (`phase_timer`): `task_start` (the methods'
                         task-start hooks: teacher copies, adapters), `setup` (datasets, collators, the Trainer),
                         `train` (`Trainer.train`), `after_training` and `task_end` (the methods' work after the
                         steps: Fisher, covariances, caches, buffers, weight patching), `eval` (the results-matrix
                         row), `checkpoint` (writing task-<k>/; recorded once written, so the task's own checkpoint
                         lacks it)
    peak_rss_bytes       peak resident memory of the (main) process during the task: VmHWM, reset at the task's
                         start through /proc/self/clear_refs (Linux); elsewhere the process's peak so far
    peak_cuda_bytes      peak memory allocated by torch on the current CUDA device during the task (None on CPU)
    trainable_parameters parameters the optimizer updates (the model's trainable ones and the methods' own)
    method_state_bytes   per method: bytes of its state as saved in a checkpoint (tensors and JSON), after the task
    extra_storage_bytes  what the methods keep beyond the model, measured on disk: the bytes of the task checkpoint's
                         method-state files (`method_state.json` / `.safetensors`: teachers, buffers, task vectors,
                         adapters, every parameter a method keeps outside the model), read when task-<k>/ is written
                         (so the task's own checkpoint lacks it); a run that writes no checkpoints writes those files
                         to a temporary folder at the task's end and measures them
    median_step_seconds  median wall time of the task's optimizer steps on the main process, from one step's start
                         to the next's (`StepMeter.step_seconds`)

and the run (`RunPhases`, the `run` entry of `compute.json`): `startup_seconds`, from the process's start (`hf-ccl
train`, `recipes/train.py`; a Python caller: from `run()` or the learner's creation) to its first task, less the
initial evaluation: imports, config checks, building the stream and the model, restoring a checkpoint, summed over
the launches of a resumed run; `initial_eval_seconds`, the evaluation before the first task. Left out: the work after
the last task (the run folder's files, waiting for Hub pushes, printing) and the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .callbacks import StreamControl, StreamState, TaskCallback

if TYPE_CHECKING:
    from .arguments import ContinualArguments
from .distributed import all_reduce_sum_, is_main_process, world_size
from .files import write_text_atomic
from .state_files import save_states

logger = logging.getLogger(__name__)

COMPUTE_FILE = "compute.json"
#: The stem of the method-state files of a checkpoint (`hf_ccl.methods.state.STATE_STEM`, which imports this module).
METHOD_STATE_STEM = "method_state"


@dataclass
class TaskCompute:
    """Compute spent on one task."""

    task: str
    optimizer_steps: int
    #: Examples of one whole optimizer step over all processes (per device x accumulation x processes).
    global_batch: int
    #: Examples batched for training over all processes, partial batches as they are (`hf_ccl.step_meter`).
    samples_seen: int
    #: Multiply-accumulates of the training steps over all processes: measured per step shape (`macs_measured`).
    macs: float
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int | None = None
    peak_cuda_bytes: int | None = None
    trainable_parameters: int | None = None
    total_parameters: int | None = None
    method_state_bytes: dict[str, int] = field(default_factory=dict)
    #: True: `macs` measured (every step shape's first step under FlopCounterMode); False: an estimate (records of
    #: earlier versions: samples x forward MACs x passes; or steps a resume restored no counts for).
    macs_measured: bool = False
    #: Distinct step shapes measured (on the main process).
    step_shapes: int = 0
    #: Median wall seconds per optimizer step on the main process (`StepMeter`); None before two steps.
    median_step_seconds: float | None = None
    #: Bytes of the methods' state files in the task's checkpoint, on disk (None until measured).
    extra_storage_bytes: int | None = None

    @property
    def wall_seconds(self) -> float:
        """Wall time of the task over all timed phases."""
        return sum(self.seconds.values())

    @property
    def method_seconds(self) -> float:
        """The methods' own work outside the training steps (task start, after training, task end)."""
        return sum(self.seconds.get(phase, 0.0) for phase in METHOD_PHASES)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> TaskCompute:
        """A record read back from JSON; the estimate's inputs in records of earlier versions are left out."""
        names = {item.name for item in fields(cls)}
        return cls(**{key: value for key, value in record.items() if key in names})


def task_records(records: Sequence[Mapping[str, Any]]) -> list[TaskCompute]:
    """`TaskCompute` records from their JSON dicts (`compute.json`, the `cost` section of `results.json`)."""
    return [TaskCompute.from_dict(record) for record in records]


@dataclass
class RunPhases:
    """Wall time of a run outside its tasks (the `run` entry of `compute.json`), summed over its launches."""

    #: From the process's start (or `run()`, or the learner's creation) to the first task, less the initial evaluation.
    startup_seconds: float = 0.0
    #: The evaluation of the model before the first task.
    initial_eval_seconds: float = 0.0
    #: Launches (processes' `fit()`) that trained a task: 1, plus one per resume that trained on.
    launches: int = 0

    @property
    def seconds(self) -> float:
        return self.startup_seconds + self.initial_eval_seconds


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
    """(parameters the optimizer updates, all parameters): the model's and the methods' `optimizer_parameters`; none
    under a method that takes no optimizer step (`trains_model = False`: RAIL's closed-form fit)."""
    extra = [p for method in methods for p in method.optimizer_parameters()]
    total = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in extra)
    if any(not method.trains_model for method in methods):
        return 0, total
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable += sum(p.numel() for p in extra if p.requires_grad)
    return trainable, total


def state_bytes(state: Any) -> int:
    """Bytes a method's `state_dict()` takes in a checkpoint: its tensors' data plus the JSON of the rest."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) + len(str(key)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return len(json.dumps(state, default=str))


def stored_method_bytes(folder: str | Path) -> int:
    """Bytes on disk of the method-state files in a checkpoint folder: what the methods keep beyond the model."""
    paths = [Path(folder) / f"{METHOD_STATE_STEM}.{suffix}" for suffix in ("json", "safetensors")]
    return sum(path.stat().st_size for path in paths if path.exists())


def saved_method_bytes(methods: Sequence[Any]) -> int | None:
    """`stored_method_bytes` of the methods' state written as a checkpoint writes it, into a temporary folder (for a
    run that writes no checkpoints); None, with a warning, where it cannot be written (a full disk): the accounting
    never fails a run."""
    try:
        with tempfile.TemporaryDirectory(prefix="hf_ccl_state_") as folder:
            save_states({method.name: method for method in methods}, folder, METHOD_STATE_STEM,
                        extra={method.name: {"config": method.config.to_dict()} for method in methods})
            return stored_method_bytes(folder)
    except OSError as error:
        logger.warning("Could not write the method state to a temporary folder to measure its size: %s", error)
        return None


def save_compute(records: list[TaskCompute], directory: str | Path, run: RunPhases | None = None) -> None:
    tasks = [asdict(record) for record in records]
    phases = None if run is None else asdict(run)
    payload = {"tasks": tasks, "run": phases, **cost_totals(tasks, phases)}
    write_text_atomic(Path(directory) / COMPUTE_FILE, json.dumps(payload, indent=2) + "\n")


def cost_totals(records: list[dict[str, Any]], run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's totals of per-task cost records (as dicts) and of its `RunPhases` (as a dict, if given): wall
    seconds by phase (`startup` and `initial_eval` besides the tasks' phases), the evaluation's share, the largest
    peak memory and trainable-parameter count, samples and MACs."""
    seconds = {phase: sum(record.get("seconds", {}).get(phase, 0.0) for record in records) for phase in PHASES}
    if run is not None:
        seconds = {"startup": run.get("startup_seconds", 0.0), "initial_eval": run.get("initial_eval_seconds", 0.0),
                   **seconds}
    wall = sum(seconds.values())
    evaluation = seconds["eval"] + seconds.get("initial_eval", 0.0)

    def largest(key: str) -> int | None:
        values = [record[key] for record in records if record.get(key) is not None]
        return max(values) if values else None

    step_times = [record["median_step_seconds"] for record in records if record.get("median_step_seconds") is not None]

    return {
        "total_seconds": seconds,
        "total_wall_seconds": wall,
        "eval_share": evaluation / wall if wall else None,
        "max_peak_rss_bytes": largest("peak_rss_bytes"),
        "max_peak_cuda_bytes": largest("peak_cuda_bytes"),
        "max_trainable_parameters": largest("trainable_parameters"),
        "final_method_state_bytes": sum(records[-1].get("method_state_bytes", {}).values()) if records else 0,
        "max_extra_storage_bytes": largest("extra_storage_bytes"),
        "median_step_seconds": statistics.median(step_times) if step_times else None,
        "total_samples_seen": sum(record.get("samples_seen", 0) for record in records),
        "total_macs": sum(record.get("macs", 0.0) for record in records),
        "macs_measured": all(record.get("macs_measured", False) for record in records),
    }


#: Columns of the cost part of a table over runs (the all-methods benchmarks), filled by `run_cost_cells`.
RUN_COST_HEADER = ("wall (s)", "train (s)", "eval (s)", "methods (s)", "time/step (s)", "peak memory", "trainable",
                   "extra storage", "samples", "MACs")
RUN_COST_NOTE = ("Cost columns (`hf_ccl.compute`, mean over seeds): wall = all timed phases of the run; methods = the "
                 "methods' task-start, after-training and task-end work; time/step = the median over tasks of each task's median "
                 "optimizer-step wall time (`StepMeter`: from one step's start to the next's); peak memory = the "
                 "largest per-task peak: "
                 "allocated CUDA memory on a GPU, else the RSS of the benchmark's process (one process runs every "
                 "configuration, so it includes what the process already held); trainable = the most parameters the "
                 "optimizer updated in any task; extra storage = the most bytes the methods' state files of a task "
                 "checkpoint took on disk (teachers, buffers, task vectors, adapters: what a method keeps beyond the "
                 "model); samples and MACs = the training work.")


def run_cost(records: list[TaskCompute]) -> dict[str, float | None]:
    """One run's cost as flat numbers (for tables over runs): `cost_totals` of the loop's records, by key."""
    totals = cost_totals([asdict(record) for record in records])
    seconds = totals["total_seconds"]
    return {
        "wall_s": totals["total_wall_seconds"], "train_s": seconds["train"], "eval_s": seconds["eval"],
        "methods_s": sum(seconds[phase] for phase in METHOD_PHASES), "peak_rss_bytes": totals["max_peak_rss_bytes"],
        "peak_cuda_bytes": totals["max_peak_cuda_bytes"], "trainable_parameters": totals["max_trainable_parameters"],
        "method_state_bytes": totals["final_method_state_bytes"], "samples": totals["total_samples_seen"],
        "macs": totals["total_macs"], "step_s": totals["median_step_seconds"],
        "extra_storage_bytes": totals["max_extra_storage_bytes"],
    }


def mean_run_cost(costs: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Key-wise mean of `run_cost` dicts (over seeds); None where no run recorded the key."""
    mean: dict[str, float | None] = {}
    for key in dict.fromkeys(key for cost in costs for key in cost):
        values = [value for cost in costs if (value := cost.get(key)) is not None]
        mean[key] = sum(values) / len(values) if values else None
    return mean


def run_cost_cells(cost: dict[str, float | None]) -> str:
    """The `RUN_COST_HEADER` cells of one table row, joined by ` | ` (peak CUDA replaces peak RSS where recorded)."""
    peak = cost.get("peak_cuda_bytes") or cost.get("peak_rss_bytes")
    trainable = cost.get("trainable_parameters")
    step, storage = cost.get("step_s"), cost.get("extra_storage_bytes")
    cells = [f"{cost[key]:.1f}" for key in ("wall_s", "train_s", "eval_s", "methods_s")]
    cells += [f"{step:.3f}" if step is not None else "-", format_bytes(peak) if peak is not None else "-",
              format_count(int(trainable)) if trainable is not None else "-",
              format_bytes(storage) if storage is not None else "-", f"{cost['samples']:,.0f}", f"{cost['macs']:.2e}"]
    return " | ".join(cells)


def load_compute(directory: str | Path) -> tuple[list[TaskCompute], RunPhases]:
    """The task records and run phases of a `compute.json` (none and empty phases when there is no file)."""
    path = Path(directory) / COMPUTE_FILE
    if not path.exists():
        return [], RunPhases()
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return task_records(payload["tasks"]), RunPhases(**(payload.get("run") or {}))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error


def macs_text(record: TaskCompute) -> str:
    """A task's MACs for a table or summary: `1.23e+09`, or `~1.23e+09` when estimated."""
    return f"{'' if record.macs_measured else '~'}{record.macs:.2e}"


def compute_summary(records: list[TaskCompute], run: RunPhases | None = None) -> str:
    """One line per task and a total: samples seen, optimizer steps, MACs, then the wall time by phase, peak memory,
    trainable parameters and method state where recorded, with the run's start-up and initial evaluation."""
    lines = ["Compute per task (samples seen: the rows of every training batch, over all processes; MACs: measured "
             "per step shape, ~ an estimate):"]
    for record in records:
        lines.append(f"  {record.task}: {record.samples_seen:,} samples ({record.optimizer_steps} steps of up to "
                     f"{record.global_batch}), {macs_text(record)} MACs")
    total = sum(r.samples_seen for r in records)
    estimated = "" if all(r.macs_measured for r in records) else "~"
    lines.append(f"  total: {total:,} samples, {estimated}{sum(r.macs for r in records):.2e} MACs")
    timed = [record for record in records if record.seconds]
    if timed:
        lines.append("Cost per task (wall seconds: train / eval / methods / other; peak memory; trainable "
                     "parameters; method state):")
        if run is not None and run.launches:
            launches = f"; {run.launches} launches" if run.launches > 1 else ""
            lines.append(f"  start-up: {run.startup_seconds:.1f} s (from the start to the first task: imports, checks, "
                         f"stream, model{launches})")
            lines.append(f"  initial evaluation: {run.initial_eval_seconds:.1f} s")
        for record in timed:
            lines.append(f"  {record.task}: {cost_line(record)}")
        outside = run.seconds if run is not None else 0.0
        wall = sum(r.wall_seconds for r in timed) + outside
        evaluation = sum(r.seconds.get("eval", 0.0) for r in timed) + (run.initial_eval_seconds if run else 0.0)
        lines.append(f"  total: {wall:.1f} s, of which training {sum(r.seconds.get('train', 0.0) for r in timed):.1f} s"
                     f", evaluation {evaluation:.1f} s ({100 * evaluation / wall if wall else 0:.0f}%), methods "
                     f"{sum(r.method_seconds for r in timed):.1f} s" + (f", start-up {run.startup_seconds:.1f} s"
                                                                         if run is not None and run.launches else ""))
    return "\n".join(lines)


def cost_line(record: TaskCompute) -> str:
    """`12.3 s (train 10.1 / eval 1.2 / methods 0.4 / other 0.6), peak RSS 1.2 GiB, 3.4M trainable, method state
    1.0 MiB, extra storage 1.0 MiB, 0.123 s/step` (the last two where measured)."""
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
    if record.extra_storage_bytes is not None:
        parts.append(f"extra storage {format_bytes(record.extra_storage_bytes)}")
    if record.median_step_seconds is not None:
        parts.append(f"{record.median_step_seconds:.3f} s/step")
    return ", ".join(parts)


def cost_table(records: list[TaskCompute], run: Mapping[str, Any] | RunPhases | None = None) -> list[str]:
    """Markdown table of what the run cost: its start-up and initial evaluation (with `run`), one row per task and a
    total row (empty without timed records)."""
    timed = [record for record in records if record.seconds]
    if not timed:
        return []
    phases = RunPhases(**run) if isinstance(run, Mapping) else run
    lines = ["| task | wall (s) | train (s) | eval (s) | methods (s) | checkpoint (s) | time/step (s) | peak RSS | "
             "peak CUDA | trainable params | method state | extra storage | samples | MACs |", "|---" * 14 + "|"]

    def row(label: str, rs: list[TaskCompute], outside: RunPhases | None = None) -> str:
        seconds = {phase: sum(r.seconds.get(phase, 0.0) for r in rs) for phase in PHASES}
        rss = [r.peak_rss_bytes for r in rs if r.peak_rss_bytes is not None]
        cuda = [r.peak_cuda_bytes for r in rs if r.peak_cuda_bytes is not None]
        state = rs[-1].method_state_bytes
        checkpoint = f"{seconds['checkpoint']:.2f}" if any("checkpoint" in r.seconds for r in rs) else "-"
        initial = outside.initial_eval_seconds if outside is not None else 0.0
        macs = ("" if all(r.macs_measured for r in rs) else "~") + f"{sum(r.macs for r in rs):.2e}"
        steps = [r.median_step_seconds for r in rs if r.median_step_seconds is not None]
        storage = [r.extra_storage_bytes for r in rs if r.extra_storage_bytes is not None]
        return (f"| {label} | {sum(seconds.values()) + (outside.seconds if outside else 0.0):.2f} | {seconds['train']:.2f} | "
                f"{seconds['eval'] + initial:.2f} | {sum(seconds[p] for p in METHOD_PHASES):.2f} | {checkpoint} | "
                f"{f'{statistics.median(steps):.3f}' if steps else '-'} | "
                f"{format_bytes(max(rss)) if rss else '-'} | {format_bytes(max(cuda)) if cuda else '-'} | "
                f"{format_count(max(r.trainable_parameters or 0 for r in rs))} | "
                f"{format_bytes(sum(state.values()))} | {format_bytes(max(storage)) if storage else '-'} | "
                f"{sum(r.samples_seen for r in rs):,} | {macs} |")

    if phases is not None and phases.launches:
        lines.append(f"| start-up | {phases.startup_seconds:.2f} |" + " - |" * 12)
        lines.append(f"| initial evaluation | {phases.initial_eval_seconds:.2f} | - | "
                     f"{phases.initial_eval_seconds:.2f} |" + " - |" * 10)
    lines += [row(record.task, [record]) for record in timed]
    lines.append(row("**total**", timed, phases))
    lines += ["", "Wall time by phase: start-up = from the process's start to the first task, less the initial "
              "evaluation (imports, config checks, building the stream and the model, restoring a checkpoint; summed "
              "over the launches of a resumed run); train = `Trainer.train`; methods = their task-start, "
              "after-training and task-end work (teachers, Fisher, buffers, patching); checkpoint = writing task-<k>/ "
              "(missing for a task in its own checkpoint). Time/step: the median wall time of an optimizer step, from one "
              "step's start to the next's (total row: the median of the tasks'). Not counted: the work after the last task (the run "
              "folder's files, waiting for Hub pushes) and the interpreter's exit. Peak memory: of the main process "
              "during the task; total row: the largest. Trainable params: total row = the most in any task. Method "
              "state: bytes of all methods' state in the checkpoint (total row: after the last task). Extra storage: the "
              "bytes the methods' state files take on disk in the task checkpoint, what a method keeps beyond the model "
              "(missing for a task in its own checkpoint; total row: the largest). Samples: the "
              "rows of every training batch over all processes. MACs: measured, every step shape's first step under "
              "torch's FlopCounterMode (forward, backward, the methods' work); ~ marks an estimate."]
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


def trained_counts(trainer: Any) -> tuple[int, float, bool]:
    """(samples, MACs, whether every step was measured) of a task's training steps, summed over the processes
    (every process calls this)."""
    meter = trainer.step_meter
    totals = torch.tensor([meter.samples, meter.macs, meter.unmeasured_steps, not meter.measured],
                          dtype=torch.float64, device=trainer.args.device)
    samples, macs, unmeasured, estimated = all_reduce_sum_(totals).tolist()
    if unmeasured:  # a resume restored no counts: those steps' batches are taken as whole
        samples += meter.unmeasured_steps * global_batch_size(trainer.args.to_dict())
    return int(samples), macs, not (unmeasured or estimated)


class ComputeCallback(TaskCallback):
    """Records what the run cost: every trained task (`TaskCompute`) and the run's start-up and initial evaluation
    (`RunPhases`), in `compute.json` in every checkpoint and the run folder, and in the `cost` section of the
    results. Its records are its state (`state_dict`): a resumed run adds to them."""

    state_key = "compute"

    def __init__(self) -> None:
        self.records: list[TaskCompute] = []
        self.run = RunPhases()
        self._launch_pending = False  # this fit()'s start-up is not recorded yet
        self._parameters: tuple[int, int] = (0, 0)
        self._restored: Path | None = None  # the task checkpoint this launch resumed from

    def on_stream_begin(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self._launch_pending = True

    def on_task_begin(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        """The launch's start-up and initial evaluation, at its first task (a resumed finished run trains none and
        adds none: its files stay those of the last task checkpoint), with the extra storage of the checkpoint it
        resumed from; then a new peak-memory window."""
        if self._restored is not None:  # the restored checkpoint's own task: its extra storage, not recorded in it
            if self.records and self.records[-1].extra_storage_bytes is None:
                self.records[-1].extra_storage_bytes = stored_method_bytes(self._restored)
            self._restored = None
        if self._launch_pending:
            learner = kwargs["learner"]
            self.run.startup_seconds += time.time() - learner.started_at - learner.initial_eval_seconds
            self.run.initial_eval_seconds += learner.initial_eval_seconds
            self.run.launches += 1
            learner.results.cost_run = asdict(self.run)
            self._launch_pending = False
        reset_peak_memory()

    def on_train_begin(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        learner = kwargs["learner"]
        self._parameters = trainable_parameter_count(learner.model, learner.methods)

    def on_task_trained(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        trainer = kwargs["trainer"]
        samples, macs, measured = trained_counts(trainer)
        record = TaskCompute(kwargs["context"].task.name, trainer.state.global_step,
                             global_batch_size(trainer.args.to_dict()), samples, macs, macs_measured=measured,
                             step_shapes=len(trainer.step_meter.macs_per_step),
                             median_step_seconds=trainer.step_meter.median_step_seconds)
        record.trainable_parameters, record.total_parameters = self._parameters
        record.seconds = kwargs["context"].phase_seconds  # the loop's clock: later phases land here too
        self.records.append(record)

    def on_task_end(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        learner, record = kwargs["learner"], self.records[-1]
        record.peak_rss_bytes, record.peak_cuda_bytes = peak_memory()
        record.method_state_bytes = {method.name: state_bytes(method.state_dict()) for method in learner.methods}
        if not learner.writes_checkpoints and is_main_process():  # else measured in the checkpoint, once written
            record.extra_storage_bytes = saved_method_bytes(learner.methods)
        learner.results.cost = [asdict(record) for record in self.records]

    def on_checkpoint_saved(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if self.records:
            self.records[-1].extra_storage_bytes = stored_method_bytes(kwargs["folder"])
        kwargs["learner"].results.cost = [asdict(record) for record in self.records]  # with the checkpoint's time

    def on_restore(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        self._restored = Path(kwargs["folder"])

    def on_save(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        save_compute(self.records, kwargs["folder"], self.run)  # for readers; a resume reads `state_dict`

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": [asdict(record) for record in self.records], "run": asdict(self.run)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records, self.run = task_records(state["tasks"]), RunPhases(**state["run"])


def compute_state(directory: str | Path) -> dict[str, Any]:
    """`ComputeCallback`'s state from the `compute.json` of a checkpoint written before the callbacks' state
    protocol (`callback_state.json`)."""
    records, run = load_compute(directory)
    return {"tasks": [asdict(record) for record in records], "run": asdict(run)}
