"""benchmarks/gpu_check.py without a GPU: it refuses at once on this machine; its plan (which steps for one GPU and for
two, the commands a user runs, timeouts within ten minutes), each step's status and the result files are checked with
stand-in commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402  (benchmarks/ is not a package)

from hf_ccl.cli import prepare  # noqa: E402
from hf_ccl.validation import ConfigError  # noqa: E402


def test_it_refuses_at_once_without_cuda(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--output-dir", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2
    assert result.stderr.startswith("gpu_check.py: error: needs a CUDA GPU: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def names(gpus: int, tmp_path: Path) -> list[str]:
    return [step.name for step in gpu_check.plan(gpus, tmp_path / "runs", tmp_path)]


def test_the_plan_for_one_and_for_two_gpus(tmp_path):
    assert names(1, tmp_path) == ["one-gpu", "fsdp2-1gpu", "bf16", "compile", "method-speed"]
    assert names(2, tmp_path) == ["one-gpu", "ddp-2gpu", "fsdp2-2gpu", "bf16", "compile", "method-speed"]
    assert names(8, tmp_path) == names(2, tmp_path)  # two processes at most: the check stays under ten minutes
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        gpu_check.plan(0, tmp_path, tmp_path)
    for gpus in (1, 2):
        steps = gpu_check.plan(gpus, tmp_path / "runs", tmp_path)
        assert sum(step.timeout_s for step in steps) <= gpu_check.BUDGET_S < 600
        assert all(step.timeout_s >= 60 for step in steps)
        assert [step.name for step in steps if step.may_refuse] == [f"fsdp2-{gpus}gpu"]


def test_each_step_is_the_command_a_user_runs(tmp_path):
    steps = {step.name: step for step in gpu_check.plan(2, tmp_path / "runs", tmp_path)}
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    for name in ("one-gpu", "ddp-2gpu", "fsdp2-2gpu", "bf16", "compile"):
        command = steps[name].command
        assert command[:3] == launcher and "recipes/train.py" in command
        assert f"output_dir={tmp_path / 'runs' / name}" in command and steps[name].output_dir
    processes = {name: steps[name].command[steps[name].command.index("--num_processes") + 1] for name in steps
                 if name != "method-speed"}
    assert processes == {"one-gpu": "1", "ddp-2gpu": "2", "fsdp2-2gpu": "2", "bf16": "1", "compile": "1"}
    gpu_ids = {name: steps[name].command[steps[name].command.index("--gpu_ids") + 1] for name in processes}
    assert gpu_ids == {"one-gpu": "0", "ddp-2gpu": "0,1", "fsdp2-2gpu": "0,1", "bf16": "0", "compile": "0"}
    assert "--multi_gpu" in steps["ddp-2gpu"].command
    assert {"--use_fsdp", "--fsdp_version", "2"} <= set(steps["fsdp2-2gpu"].command)
    assert "training.bf16=true" in steps["bf16"].command
    assert "training.torch_compile=true" in steps["compile"].command
    speed = steps["method-speed"].command
    assert speed[1] == "benchmarks/gpu_speed.py" and speed[speed.index("--size") + 1] == "vit-b-32"


def test_the_runs_overrides_are_valid(tmp_path):
    """The recipe and overrides every run step passes are taken by hf_ccl's config check (no data read, nothing
    written); bf16 is refused only for want of a GPU on this machine."""
    for step in gpu_check.plan(1, tmp_path / "runs", tmp_path):
        if not step.output_dir:
            continue
        arguments = step.command[step.command.index("recipes/train.py") + 1:]
        config, overrides = arguments[1], arguments[2:]
        if step.name == "bf16":
            with pytest.raises(ConfigError, match="training.bf16 on a machine without a GPU"):
                prepare(config, overrides)
        else:
            prepare(config, overrides)
    assert not (tmp_path / "runs").exists()


def ended(pid: int, wait_s: float = 10) -> bool:
    """Whether a process has ended within `wait_s` (a zombie, not yet reaped by its new parent, has)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def stand_in(name: str, code: str, timeout_s: int = 60, may_refuse: bool = False) -> gpu_check.Step:
    return gpu_check.Step(name, f"stand-in {name}", [sys.executable, "-c", code], timeout_s, may_refuse)


def test_step_status_timeout_and_result_files(tmp_path, monkeypatch, capsys):
    """passed, refused (hf_ccl's one-line error, exit 2), failed, timed out (its process group ended, children too);
    the .md and .json result files name the device; the exit code is 1 when a step that must pass did not."""
    child = tmp_path / "child.pid"
    sleeper = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
               f"time.sleep(60)']); open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    steps = [stand_in("ok", "print('trained')"),
             stand_in("refused", "import sys; print('hf-ccl: error: FSDP needs a GPU', file=sys.stderr); sys.exit(2)",
                      may_refuse=True),
             stand_in("refused-under-a-launcher", "print('hf-ccl: error: one process'); print('  exitcode  : 2 (pid: 7)');"
                      " raise SystemExit(1)", may_refuse=True),
             stand_in("refused-one-process", "print('hf-ccl: error: bf16'); print('... returned non-zero exit status 2.');"
                      " raise SystemExit(1)", may_refuse=True),
             stand_in("failed", "print('hf-ccl: error: disk full'); raise SystemExit(1)"),
             stand_in("slow", sleeper, timeout_s=3)]
    device = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "driver": "575.57", "torch": "2.13.0", "cuda": "12.8",
              "bf16": True, "memory_gib": 79.2}
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_report", lambda: device)
    monkeypatch.setattr(gpu_check, "plan", lambda gpus, runs, results: steps)
    assert gpu_check.main(["--output-dir", str(tmp_path / "results")]) == 1
    assert "not passed: failed, slow" in capsys.readouterr().out
    report = json.loads((tmp_path / "results" / "gpu_check_nvidia-h100-80gb-hbm3.json").read_text())
    assert report["device"] == device["device"] and report["driver"] == "575.57" and report["gpus"] == 1
    status = {step["name"]: step["status"] for step in report["steps"]}
    assert status == {"ok": "passed", "refused": "refused", "refused-under-a-launcher": "refused",
                      "refused-one-process": "refused", "failed": "failed",
                      "slow": "timed out"}
    refused = report["steps"][1]
    assert refused["refusal"] == "hf-ccl: error: FSDP needs a GPU" and refused["returncode"] == 2
    assert "trained" in report["steps"][0]["tail"] and 3 <= report["steps"][5]["wall_s"] < 30
    assert ended(int(child.read_text()))  # the timed-out step's own child was ended with it
    markdown = (tmp_path / "results" / "gpu_check_nvidia-h100-80gb-hbm3.md").read_text()
    assert markdown.startswith("# GPU check: NVIDIA H100 80GB HBM3")
    assert "| refused | stand-in refused | refused: hf-ccl: error: FSDP needs a GPU |" in markdown


def test_only_a_refusal_of_a_step_that_may_refuse_passes(tmp_path, monkeypatch):
    steps = [stand_in("fsdp2", "import sys; print('hf-ccl: error: no'); sys.exit(2)", may_refuse=True)]
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "device_report", lambda: {
        "device": "X", "gpus": 1, "driver": "1", "torch": "2", "cuda": "12", "bf16": True, "memory_gib": 1.0})
    monkeypatch.setattr(gpu_check, "plan", lambda gpus, runs, results: steps)
    assert gpu_check.main(["--output-dir", str(tmp_path)]) == 0
    steps[0].may_refuse = False
    assert gpu_check.main(["--output-dir", str(tmp_path)]) == 1
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
