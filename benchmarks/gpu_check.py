"""The GPU check in one command: every training path a GPU user takes, each under its own timeout, in under ten
minutes on one GPU, with one result file naming the device.

    python benchmarks/gpu_check.py [--output-dir benchmarks/results]

Runs, as a user runs them (`accelerate launch recipes/train.py --config digits ...`, a short digits stream):
one GPU; DDP on two GPUs (where the machine has them); FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`, on two
GPUs where there are two: on one, the run is refused, and the refusal is the result); bf16 (`training.bf16`);
`torch.compile` (`training.torch_compile`); the method speed table at the ViT-B/32 shape (`gpu_speed.py`, few steps,
bf16). Writes benchmarks/results/gpu_check_<device>.md and .json: the device (name, driver, torch and CUDA versions,
GPU count) and each step's status (passed, refused: hf_ccl's one-line refusal, failed, timed out), wall time and
output tail. Exits 1 when a step that must pass did not, 2 at once (nothing run) on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: Wall-clock budget of all steps together (seconds): ten minutes less the script's own start-up and device query.
BUDGET_S = 570
#: A short run of the README's recipe: the digits stream with fewer rows and epochs (the model is the recipe's).
SHORT_RUN = ["--config", "digits", "stream_args.max_train_per_task=256", "stream_args.max_eval_per_task=64",
             "training.num_train_epochs=2"]
TAIL_CHARS = 3000


@dataclass
class Step:
    """One command of the check, run from the repository root."""

    name: str
    what: str
    command: list[str]
    timeout_s: int
    may_refuse: bool = False  # a one-line hf_ccl refusal (exit code 2) is a result, not a failure
    output_dir: str = ""  # the run folder the command writes, removed afterwards


@dataclass
class Outcome:
    name: str
    what: str
    command: str
    status: str  # passed | refused | failed | timed out
    wall_s: float
    timeout_s: int
    returncode: int | None
    refusal: str = ""
    tail: str = field(default="", repr=False)


def launch(processes: int, *options: str) -> list[str]:
    """`accelerate launch` of recipes/train.py with `processes` processes, one per GPU, on the first `processes` GPUs
    (one process that saw several GPUs would be refused: the Trainer would wrap the model in nn.DataParallel)."""
    distributed = ["--multi_gpu"] if processes > 1 and "--use_fsdp" not in options else []
    gpu_ids = ",".join(map(str, range(processes)))
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--gpu_ids", gpu_ids,
            "--num_machines", "1", "--dynamo_backend", "no", *distributed, *options, "recipes/train.py"]


def plan(gpus: int, runs: Path, results: Path) -> list[Step]:
    """The steps for a machine with `gpus` GPUs (the two-GPU ones only where there are two), their run folders under
    `runs`, the speed table written into `results`; their timeouts sum to at most `BUDGET_S`."""
    if gpus < 1:
        raise ValueError(f"gpu_check needs a CUDA GPU, and {gpus} were given")

    def run(name: str, what: str, processes: int, timeout_s: int, *overrides: str, options: tuple[str, ...] = (),
            may_refuse: bool = False) -> Step:
        output_dir = str(runs / name)
        command = [*launch(processes, "--mixed_precision", "no", *options), *SHORT_RUN,
                   f"output_dir={output_dir}", *overrides]
        return Step(name, what, command, timeout_s, may_refuse, output_dir)

    fsdp_processes = min(gpus, 2)
    steps = [
        run("one-gpu", "one process on one GPU (the README's command)", 1, 60),
        *([run("ddp-2gpu", "DDP on two GPUs (accelerate launch --multi_gpu --num_processes 2)", 2, 75)]
          if gpus >= 2 else []),
        run(f"fsdp2-{fsdp_processes}gpu", f"FSDP2 on {fsdp_processes} GPU(s) (accelerate launch --use_fsdp "
            "--fsdp_version 2); one process is refused", fsdp_processes, 75,
            options=("--use_fsdp", "--fsdp_version", "2"), may_refuse=True),
        run("bf16", "bf16 autocast (training.bf16: true), one GPU", 1, 60, "training.bf16=true"),
        run("compile", "torch.compile (training.torch_compile: true), one GPU", 1, 140, "training.torch_compile=true"),
        Step("method-speed", "the method speed table at the ViT-B/32 shape, bf16 (benchmarks/gpu_speed.py, few steps)",
             [sys.executable, "benchmarks/gpu_speed.py", "--size", "vit-b-32", "--batch", "64", "--accumulation", "1",
              "--steps", "3", "--rounds", "1", "--no-compile", "--output",
              str(results / "method_speed_gpu_check.md")], 160),
    ]
    assert sum(step.timeout_s for step in steps) <= BUDGET_S, [(s.name, s.timeout_s) for s in steps]
    return steps


def refusal_line(output: str) -> str:
    """hf_ccl's one-line refusal (`hf-ccl: error: ...`) in a command's output, or ""."""
    lines = [line for line in output.splitlines() if line.startswith("hf-ccl: error:")]
    return lines[-1] if lines else ""


def refused_exit(returncode: int, output: str) -> bool:
    """Whether hf_ccl exited with its refusal code (2): its own, or, as `accelerate launch` (which exits 1 when its
    worker fails) reports its worker's: `exitcode  : 2` (several processes), `returned non-zero exit status 2` (one)."""
    return returncode == 2 or re.search(r"exitcode\s*:\s*2\b|returned non-zero exit status 2\b", output) is not None


def run_step(step: Step) -> Outcome:
    """Run one step in its own process group (so a timeout ends the launcher's workers too)."""
    started = time.perf_counter()
    process = subprocess.Popen(step.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=step.timeout_s)
        returncode: int | None = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        returncode = None
    wall_s = time.perf_counter() - started
    refusal = refusal_line(output)
    if returncode is None:
        status = "timed out"
    elif returncode == 0:
        status = "passed"
    elif refusal and refused_exit(returncode, output):
        status = "refused"
    else:
        status = "failed"
    if step.output_dir:
        shutil.rmtree(step.output_dir, ignore_errors=True)
    return Outcome(step.name, step.what, " ".join(step.command).replace(sys.executable, "python"), status,
                   round(wall_s, 1), step.timeout_s, returncode, refusal, output[-TAIL_CHARS:])


def step_ok(step: Step, outcome: Outcome) -> bool:
    return outcome.status == "passed" or (outcome.status == "refused" and step.may_refuse)


def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi), or why it is unknown."""
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({type(error).__name__})"
    return result.stdout.splitlines()[0].strip() if result.stdout.strip() else "unknown"


def device_report() -> dict:
    name = torch.cuda.get_device_name(0)
    return {"device": name, "gpus": torch.cuda.device_count(), "driver": driver_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported(),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def device_slug(name: str) -> str:
    """A file-name form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def markdown(device: dict, outcomes: list[Outcome], total_s: float) -> str:
    lines = [f"# GPU check: {device['device']}", "",
             f"{device['gpus']} x {device['device']} ({device['memory_gib']} GiB), driver {device['driver']}, "
             f"torch {device['torch']}, CUDA {device['cuda']}, bf16 {'yes' if device['bf16'] else 'no'}; "
             f"{total_s:.0f} s in all. Command: `python benchmarks/gpu_check.py`.", "",
             "| step | what | status | wall (s) | timeout (s) |", "|---|---|---|---|---|"]
    for outcome in outcomes:
        status = f"{outcome.status}: {outcome.refusal}" if outcome.refusal and outcome.status != "passed" else \
            outcome.status
        lines.append(f"| {outcome.name} | {outcome.what} | {status} | {outcome.wall_s} | {outcome.timeout_s} |")
    for outcome in outcomes:
        lines += ["", f"## {outcome.name}", "", f"`{outcome.command}`", "", "```", outcome.tail.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check.py: error: needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}); "
              "on a CPU machine the tests and benchmarks/method_speed.py are the checks", file=sys.stderr)
        return 2
    device = device_report()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_ccl_gpu_check_") as runs:
        steps = plan(device["gpus"], Path(runs), Path(args.output_dir))
        outcomes = []
        for step in steps:
            print(f"gpu_check: {step.name} (timeout {step.timeout_s} s) ...", flush=True)
            outcomes.append(run_step(step))
            print(f"gpu_check: {step.name}: {outcomes[-1].status} in {outcomes[-1].wall_s} s", flush=True)
    total_s = time.perf_counter() - started
    output = Path(args.output_dir) / f"gpu_check_{device_slug(device['device'])}"
    output.with_suffix(".md").write_text(markdown(device, outcomes, total_s), encoding="utf-8")
    output.with_suffix(".json").write_text(json.dumps(
        {**device, "total_s": round(total_s, 1), "steps": [asdict(outcome) for outcome in outcomes]}, indent=1) + "\n",
        encoding="utf-8")
    failed = [step.name for step, outcome in zip(steps, outcomes, strict=True) if not step_ok(step, outcome)]
    print(f"gpu_check: wrote {output.with_suffix('.md')}" + (f"; not passed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
