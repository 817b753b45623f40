"""Peak memory per process of `hf-ccl train`, one process against 2-process DDP and 2-process FSDP2, beside what the
model's parameter count predicts (bytes per parameter, per method).

Each run is the user's command on a random CLIP saved as a checkpoint folder (`model.pretrained`): a ViT-B/32-shaped
one (`method_speed.clip_config("vit-b-32")`, 151 M parameters) and a wider one (ViT-L/32 widths at ViT-B depth, 279 M),
trained on two tasks of the bundled CIFAR-10 subset (`STREAM`: classes 0-1, then 2-3; `training.max_steps` steps
each, batch 8 per process, fp32, images upscaled to 224 px), with each task's checkpoint written, as a user's run does:

    one process   python -m hf_ccl.cli train --config digits stream=<STREAM> model.pretrained=<folder> ...
    DDP           accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
                  --dynamo_backend no --main_process_port <port> -m hf_ccl.cli train ... (gloo on a CPU)
    FSDP2         the DDP launch with `training.fsdp=true` (`FSDP_OVERRIDES`); on a machine without a GPU the worker
                  first flips accelerate's device gate as tests/scripts/fsdp_on_cpu.py does (accelerate keeps its FSDP
                  plugin only on GPU-like devices; everything else is the GPU user's path)

Every process runs `hf_ccl.cli.main` inside this script's `--worker` mode, which records the process's peak resident
memory (VmHWM; hf_ccl's per-task accounting resets VmHWM at each task start, so the worker folds the peak into its
own maximum before each reset) and, on a GPU, `torch.cuda.max_memory_allocated`. A run that is refused or fails
records its first error line. The runtime baseline is a process that imports what `hf-ccl train` imports and builds
nothing. Runs go one at a time, `OMP_NUM_THREADS=1` per process; a run whose expected peak does not fit in the
machine's available memory is skipped and says so.

    python benchmarks/memory.py [--sizes vit-b-32 wide] [--methods finetune modx ctp zscl] [--steps 2]

Writes benchmarks/results/memory.md and memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 1024**3
#: Two tasks, so that the second one has the teachers; a stream spec the CLI takes as an override.
STREAM = "{builder: by_class, train: cifar10, class_groups: [[0, 1], [2, 3]]}"
#: Bytes per parameter measured beyond the expectation (activations; ZSCL: 8), plus 1 GiB, when deciding
#: whether a run fits in the available memory.
MARGIN = 5
RUN_TIMEOUT = 1800  # seconds; a run past it (a hung process group) is killed and recorded as failed
MODES = ("one process", "DDP x2", "FSDP2 x2")
METHODS = ("finetune", "modx", "ctp", "zscl")
#: How the FSDP2 column asks for sharding (the launch is the DDP one).
FSDP_OVERRIDES = ["training.fsdp=true"]
#: Per method: frozen whole-model copies it keeps beside the student during a task after the first (read from
#: hf_ccl/methods/*.py): Mod-X its teacher (`TeacherMethod`); CTP the previous-task model R and the momentum model M
#: (`FrozenTeacher` each); ZSCL the initial weights θ_0 as a CPU state dict (method state, all run), its teacher
#: built from them, and the weight ensemble's running mean (float32, from the task's first step).
MODEL_COPIES = {"finetune": 0, "modx": 1, "ctp": 2, "zscl": 3}
#: Of those, the copies FSDP2 shards like the student (docs/scale.md, FSDP2): ZSCL's weight-ensemble mean. The teachers,
#: CTP's momentum and previous models and ZSCL's θ_0 and teacher stay whole on every process.
SHARDED_COPIES = {"zscl": 1}
METHOD_ARGS = {  # small enough for a few steps; CTP's queue and ZSCL's reference set are counted as method state
    "ctp": ["method_args.ctp.queue_size=1024"],
    "zscl": ["method_args.zscl.reference_examples=16", "method_args.zscl.reference_batch_size=8",
             "method_args.zscl.ensemble_every=1"],
}
#: (vision hidden, layers, heads, patch, image px; text hidden, layers, heads; projection), as `method_speed.SIZES`.
WIDE = (1024, 12, 16, 32, 224, 768, 12, 12, 768)
ROOT = Path(__file__).resolve().parents[1]
SIZE_NOTES = {"vit-b-32": " (ViT-B/32 shape: vision 768 wide, text 512, 12 layers each, 224 px)",
              "wide": " (ViT-L/32 widths at ViT-B depth: vision 1024, text 768, 12 layers each, 224 px)"}


# ----------------------------------------------------------------------------------------------------------------
# In each process: the peak of the whole run
# ----------------------------------------------------------------------------------------------------------------
def vm_hwm() -> int:
    """This process's peak resident memory since start or the last VmHWM reset (bytes; ru_maxrss without /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakTracker:
    """The process's peak RSS and CUDA allocation over the whole run, across hf_ccl's per-task peak resets."""

    def __init__(self) -> None:
        self.rss, self.cuda = 0, 0
        self.startup_rss: int | None = None

    def fold(self) -> None:
        self.rss = max(self.rss, vm_hwm())
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda = max(self.cuda, int(torch.cuda.max_memory_allocated()))

    def install(self) -> None:
        """Fold the peak so far into ours before each of hf_ccl's resets (`hf_ccl.compute.reset_peak_memory`)."""
        from hf_ccl import compute

        reset = compute.reset_peak_memory

        def fold_then_reset() -> None:
            self.fold()
            if self.startup_rss is None:  # the first reset: start-up (imports, checks, loading the model)
                self.startup_rss = self.rss
            reset()

        compute.reset_peak_memory = fold_then_reset


def worker(record_dir: Path, argv: list[str], fsdp_on_cpu: bool = False) -> int:
    """Run `hf-ccl train argv` (or, with no argv, only import what it imports) and write this rank's peaks."""
    tracker, code = PeakTracker(), 1
    try:
        if fsdp_on_cpu:
            sys.path.insert(0, str(ROOT / "tests" / "scripts"))
            from fsdp_on_cpu import keep_fsdp_on_cpu

            keep_fsdp_on_cpu()
        if argv:
            tracker.install()
            from hf_ccl.cli import main

            code = main(argv)
        else:  # the runtime baseline: what `hf-ccl train` imports before it builds anything
            import hf_ccl.cli
            import hf_ccl.continual
            import hf_ccl.run  # noqa: F401

            code = 0
    finally:
        tracker.fold()
        rank = int(os.environ.get("RANK", "0"))
        record = {"rank": rank, "exit_code": code, "peak_rss_bytes": tracker.rss, "startup_rss_bytes": tracker.startup_rss,
                  "peak_cuda_bytes": tracker.cuda or None}
        (record_dir / f"rank{rank}.json").write_text(json.dumps(record) + "\n", encoding="utf-8")
    return code


# ----------------------------------------------------------------------------------------------------------------
# Expected bytes
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Expected:
    """Bytes one process is expected to hold for the model's state (no activations, no runtime), by part."""

    student: float
    gradients: float
    optimizer: float
    ddp_buckets: float
    teachers: float

    @property
    def total(self) -> float:
        return self.student + self.gradients + self.optimizer + self.ddp_buckets + self.teachers


def expected_bytes(parameters: int, method: str, mode: str, processes: int = 2) -> Expected:
    """fp32 student (4 B/param), gradients (4), AdamW's two moments (8); DDP's reducer keeps its own gradient buckets
    (4: accelerate's default `gradient_as_bucket_view=False`); FSDP2 divides the student, its gradients, the
    optimizer state and `SHARDED_COPIES` by the processes; the methods' other copies (`MODEL_COPIES`) are 4 each."""
    shards = processes if mode.startswith("FSDP") else 1
    sharded = SHARDED_COPIES.get(method, 0) if shards > 1 else 0
    return Expected(student=4 * parameters / shards, gradients=4 * parameters / shards,
                    optimizer=8 * parameters / shards, ddp_buckets=4 * parameters if mode.startswith("DDP") else 0,
                    teachers=4 * parameters * (MODEL_COPIES[method] - sharded + sharded / shards))


# ----------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    size: str
    method: str
    mode: str
    outcome: str = "not run"  # "ok", "refused: ...", "failed: ...", "skipped: ..."
    peak_rss_bytes: list[int] = field(default_factory=list)  # per rank
    startup_rss_bytes: list[int] = field(default_factory=list)
    peak_cuda_bytes: list[int | None] = field(default_factory=list)
    task_peak_rss_bytes: int | None = None  # the main process's largest per-task peak (compute.json)
    seconds: float = 0.0
    commit: str = ""


def save_model(size: str, folder: Path) -> int:
    """A random `size` CLIP with the bundled tokenizer and a 224 px processor as a checkpoint folder; its parameters."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import method_speed
    from transformers import CLIPProcessor

    from hf_ccl.data import load_image_processor, load_tokenizer

    if size not in method_speed.SIZES:
        method_speed.SIZES[size] = WIDE
    config = method_speed.clip_config(size)
    model = method_speed.new_model(config)
    model.save_pretrained(folder)
    image_size = int(method_speed.SIZES[size][4])
    CLIPProcessor(image_processor=load_image_processor(image_size), tokenizer=load_tokenizer()).save_pretrained(folder)
    return sum(parameter.numel() for parameter in model.parameters())


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def commit() -> str:
    """The checkout's commit, with `+changes` when the library's files (hf_ccl/) differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno", "--", "hf_ccl") else "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_prefix(mode: str) -> list[str]:
    """The worker's command: this interpreter, or accelerate's launcher with 2 processes."""
    if mode == "one process":
        return [sys.executable]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]


def train_args(model: Path, method: str, mode: str, steps: int, output_dir: Path) -> list[str]:
    return ["train", "--config", "digits", f"stream={STREAM}", f"model.pretrained={model}", "model.config={}", f"methods=[{method}]",
            *METHOD_ARGS.get(method, []), *(FSDP_OVERRIDES if mode.startswith("FSDP") else []),
            f"training.max_steps={steps}", "training.per_device_train_batch_size=8", "training.logging_steps=1",
            "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=8", "evaluation.batch_size=8",
            "evaluation.initial=false", "progress=false", f"output_dir={output_dir}"]


def environment() -> dict[str, str]:
    """A user's environment: none of accelerate's variables a user would not set, one thread per process (and glibc's
    `MALLOC_MMAP_THRESHOLD_` when the benchmark's own process has it: `--malloc-mmap-threshold`)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ACCELERATE_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                      env.get("PYTHONPATH")]))}


def first_error(stderr: str) -> str:
    """The CLI's one-line error (`hf-ccl: error: ...`), else the last line of stderr."""
    for line in stderr.splitlines():
        if line.startswith("hf-ccl: error:"):
            return line.removeprefix("hf-ccl: error:").strip()
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def execute(run: Run, model: Path, parameters: int, steps: int, baseline: int, work: Path) -> Run:
    processes = 1 if run.mode == "one process" else 2
    need = processes * (baseline + expected_bytes(parameters, run.method, run.mode).total + MARGIN * parameters + GIB)
    if need > available_bytes():  # the machine is shared: never push another user's work into the OOM killer
        run.outcome = (f"skipped: needs about {need / GIB:.1f} GiB for {processes} process(es), "
                       f"{available_bytes() / GIB:.1f} GiB available")
        return run
    records, output_dir = work / "records", work / "run"
    shutil.rmtree(records, ignore_errors=True)
    shutil.rmtree(output_dir, ignore_errors=True)
    records.mkdir(parents=True)
    gate = ["--fsdp-on-cpu"] if run.mode.startswith("FSDP") and not cuda_available() else []
    command = [*launch_prefix(run.mode), str(Path(__file__).resolve()), "--worker", str(records), *gate, "--",
               *train_args(model, run.method, run.mode, steps, output_dir)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
                               cwd=ROOT, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        stderr += f"\nhf-ccl: error: timed out after {RUN_TIMEOUT} s (killed)"
    run.seconds = round(time.perf_counter() - started, 1)
    run.commit = commit()
    ranks = [json.loads(path.read_text()) for path in sorted(records.glob("rank*.json"))]
    run.peak_rss_bytes = [rank["peak_rss_bytes"] for rank in ranks]
    run.startup_rss_bytes = [rank["startup_rss_bytes"] for rank in ranks]
    run.peak_cuda_bytes = [rank["peak_cuda_bytes"] for rank in ranks]
    if process.returncode == 0 and len(ranks) == processes:
        run.outcome = "ok"
        compute = json.loads((output_dir / "compute.json").read_text())
        run.task_peak_rss_bytes = max(task["peak_rss_bytes"] or 0 for task in compute["tasks"])
    else:
        kind = "refused" if process.returncode == 2 or any(r["exit_code"] == 2 for r in ranks) else "failed"
        run.outcome = f"{kind}: {first_error(stderr)}"
    shutil.rmtree(output_dir, ignore_errors=True)
    return run


def measure_baseline(work: Path) -> int:
    records = work / "baseline"
    records.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(records)], check=True,
                   env=environment(), cwd=ROOT)
    return json.loads((records / "rank0.json").read_text())["peak_rss_bytes"]


# ----------------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------------
def gib(value: float | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def cell(run: Run, parameters: int, baseline: int) -> str:
    """Measured peak (the larger rank), its bytes per parameter over the baseline, and the expectation."""
    if run.outcome != "ok":
        words = run.outcome.split()
        return " ".join(words[:14]) + (" ..." if len(words) > 14 else "")
    peak = max(run.peak_rss_bytes)
    expected = expected_bytes(parameters, run.method, run.mode).total
    return (f"{gib(peak)} GiB: {(peak - baseline) / parameters:.1f} B/param "
            f"(expected {(baseline + expected) / GIB:.2f}: {expected / parameters:.0f} B/param)")


def versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__}


def machine() -> str:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024 / GIB if Path("/proc/meminfo").exists() else 0
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.machine()}, {cores} cores, {memory:.0f} GiB RAM, {device}"


def write_tables(report: dict[str, Any], output: Path) -> None:
    baseline = report["baseline_rss_bytes"]
    lines = [
        "# Peak memory per process: one process, DDP and FSDP2",
        "",
        f"Command: `{report['command']}` ({report['date']}; {report['machine']}; "
        + ", ".join(f"{name} {version}" for name, version in report["versions"].items()) + ").",
        "",
        f"Each cell: the peak resident memory (VmHWM) of the run's largest process over the whole run (start-up, "
        f"{report['steps']} steps of batch 8 per process on each of 2 CIFAR-10 tasks at 224 px, fp32, every task's "
        "checkpoint written); then (peak − runtime baseline) / parameters; then the expected peak, baseline + the "
        "model state the parameter count predicts (see below), and its bytes per parameter. Runtime baseline: "
        f"**{gib(baseline)} GiB** (a process that imports what `hf-ccl train` imports and builds nothing). "
        + (f"glibc's `MALLOC_MMAP_THRESHOLD_={report['malloc_mmap_threshold']}` in every process (freed large blocks "
           "go back to the system: RSS counts live memory). " if report.get("malloc_mmap_threshold") else
           "glibc's malloc as it comes (it keeps freed blocks below its dynamic mmap threshold for reuse, which RSS "
           "counts: on a CPU, FSDP2's per-unit gather and reduce buffers stay in its heap; `--malloc-mmap-threshold "
           "131072` measures live memory, results/memory_mmap.md). ") +
        "Expected per process: student 4 B/param, gradients 4, AdamW 8, DDP's gradient buckets 4 (DDP only), each "
        "whole-model copy a method keeps 4 (Mod-X 1, CTP 2, ZSCL 3); FSDP2 divides student, gradients, AdamW and "
        "ZSCL's ensemble mean by the 2 processes (the other copies stay whole on every process). Not in the "
        "expectation: activations, the evaluation, the checkpoint writer's copy, FSDP2's gather of the whole model "
        "after each task. FSDP2 on this CPU machine: accelerate's device gate flipped as tests/scripts/fsdp_on_cpu.py "
        "does (a GPU machine keeps the plugin by itself); gloo, not NCCL.",
        "",
    ]
    for size, info in report["sizes"].items():
        parameters = info["parameters"]
        lines += [f"## {size}: {parameters / 1e6:.1f} M parameters{SIZE_NOTES.get(size, '')}", "",
                  "| method | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
        for method in report["methods"]:
            runs = {run["mode"]: Run(**run) for run in report["runs"] if run["size"] == size and run["method"] == method}
            cells = [cell(runs[mode], parameters, baseline) if mode in runs else "not run" for mode in MODES]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Every run", "", "| size | method | mode | outcome | peak RSS per rank (GiB) | start-up peak (GiB) | "
              "largest task peak, main process (GiB) | peak CUDA (GiB) | seconds | commit (wt-mem branch, before a rebase) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for run in map(lambda raw: Run(**raw), report["runs"]):
        cuda = ", ".join(gib(value) for value in run.peak_cuda_bytes if value) or "—"
        lines.append(f"| {run.size} | {run.method} | {run.mode} | {run.outcome.split(':')[0]} | "
                     f"{', '.join(gib(v) for v in run.peak_rss_bytes) or '—'} | "
                     f"{', '.join(gib(v) for v in run.startup_rss_bytes if v) or '—'} | {gib(run.task_peak_rss_bytes)} | "
                     f"{cuda} | {run.seconds} | {run.commit or '—'} |")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def merged(old: dict[str, Any], new: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`old`'s runs and sizes under `new`'s header, both commands named; refused when the step counts differ."""
    if old["steps"] != args.steps:
        raise SystemExit(f"--merge: {args.output} was measured with --steps {old['steps']}, not {args.steps}")
    new["command"] = f"{old['command']}`, then `{new['command']}"
    new["methods"] = [m for m in METHODS if m in {*old["methods"], *args.methods}]
    new["sizes"], new["runs"] = dict(old["sizes"]), list(old["runs"])
    return new


def main() -> None:
    if "--worker" in sys.argv:  # one process of a run: `memory.py --worker RECORD_DIR [-- hf-ccl args]`
        index = sys.argv.index("--worker")
        argv = sys.argv[index + 2:]
        gate = argv[:1] == ["--fsdp-on-cpu"]
        argv = argv[1:] if gate else argv
        sys.exit(worker(Path(sys.argv[index + 1]), argv[1:] if argv[:1] == ["--"] else argv, gate))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["vit-b-32", "wide"], choices=["tiny", "small", "vit-b-32", "vit-b-16", "wide"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=2, help="training.max_steps of each task")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "memory.md"))
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for every run (e.g. 131072): blocks above it are mapped "
                             "and returned to the system when freed, so RSS counts live memory rather than what "
                             "malloc keeps for reuse (FSDP2's gather and reduce buffers, on CPU)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the runs of an existing --output .json that this command does not rerun (e.g. "
                             "--modes 'FSDP2 x2' once FSDP2 lands)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.malloc_mmap_threshold is not None:
        if args.malloc_mmap_threshold < 0:
            parser.error("--malloc-mmap-threshold must be >= 0")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    command = "python benchmarks/memory.py " + " ".join(re.sub(r"^/.*/", "", a) for a in sys.argv[1:])
    report: dict[str, Any] = {
        "command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "versions": versions(),
        "steps": args.steps, "methods": args.methods, "sizes": {}, "runs": [],
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    previous = Path(args.output).with_suffix(".json")
    if args.merge and previous.exists():
        report = merged(json.loads(previous.read_text()), report, args)
    with tempfile.TemporaryDirectory(prefix="hf_ccl_memory_") as temporary:
        work = Path(temporary)
        report["baseline_rss_bytes"] = baseline = measure_baseline(work)
        for size in args.sizes:
            folder = work / size
            parameters = save_model(size, folder)
            report["sizes"][size] = {"parameters": parameters}
            for method in args.methods:
                for mode in args.modes:
                    run = execute(Run(size, method, mode), folder, parameters, args.steps, baseline, work)
                    print(f"{size} {method} {mode}: {run.outcome} {[gib(v) for v in run.peak_rss_bytes]} GiB "
                          f"({run.seconds} s)", flush=True)
                    report["runs"] = [r for r in report["runs"]
                                      if (r["size"], r["method"], r["mode"]) != (size, method, mode)] + [asdict(run)]
                    write_tables(report, Path(args.output))
            shutil.rmtree(folder)


if __name__ == "__main__":
    main()
