"""Two processes with gloo on CPU, launched as users launch: `accelerate launch --multi_gpu --num_processes 2`."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_ccl.methods import available_methods

SCRIPT = Path(__file__).parent / "scripts" / "two_process_check.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_processes(script: Path, *args: str) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2 script *args` on CPU (gloo); asserts it exited 0."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()), str(script), *args,
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path):
    launch_two_processes(SCRIPT, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["world_size"] == 2
        assert abs(report["distributed_loss"] - report["reference_loss"]) < 1e-5
        assert report["max_grad_diff"] < 1e-5
        assert abs(report["accumulated_loss"] - report["accumulated_reference_loss"]) < 1e-5
        assert report["accumulated_max_grad_diff"] < 1e-5
        assert report["rows"] == 2
    assert reports[0]["param_sum"] == reports[1]["param_sum"]
    assert reports[0]["param_abs_sum"] == reports[1]["param_abs_sum"]
    assert (tmp_path / "run" / "task-1" / "model.safetensors").exists()
    sums = [report["method_param_sums"] for report in reports]
    assert set(sums[0]) >= set(available_methods())
    for name, value in sums[0].items():
        assert value == sums[1][name], f"{name}: ranks disagree after training"
