"""DeepSpeed: refused before anything is built, with the limits that stop it (`hf_ccl.training_options.DEEPSPEED_LIMITS`).

DeepSpeed is not a dependency of hf_ccl (CI does not install it). Where it is installed, one two-process launch as a
user launches (`accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2`, gloo on CPU) re-checks each limit
the refusal names (`tests/scripts/deepspeed_limits.py`), so the test fails, and the refusal is revisited, as soon as a
DeepSpeed / accelerate / torch release lifts one; and the README's command under that launcher is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import _free_port, user_env

from hf_ccl.continual import ContinualArguments
from hf_ccl.training_options import DEEPSPEED_LIMITS
from hf_ccl.validation import ConfigError

ROOT = Path(__file__).parents[1]
LIMITS_SCRIPT = ROOT / "tests" / "scripts" / "deepspeed_limits.py"


def test_training_deepspeed_is_refused_with_every_limit(tmp_path):
    with pytest.raises(ConfigError, match="training.deepspeed is not taken") as raised:
        ContinualArguments(output_dir=str(tmp_path), training={"deepspeed": "ds_config.json"})
    message = str(raised.value)
    for limit in DEEPSPEED_LIMITS.values():
        assert limit in message
    assert "accelerate launch --multi_gpu" in message and "\n" not in message


def launch_deepspeed(*args: str, stage: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch --use_deepspeed --zero_stage <stage> --num_processes 2 *args` on this CPU machine."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", str(stage),
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--main_process_port", str(_free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=user_env(), cwd=ROOT)


@pytest.mark.slow  # two launches, 30-65 s on 2 shared cores; the refusal itself is tested above and in test_trainer_paths.py
@pytest.mark.multiprocess
def test_the_limits_still_hold_on_two_cpu_processes(tmp_path):
    """DeepSpeed's engine runs here (ZeRO-2 around a SigLIP), but it refuses a CLIP's 0-d logit_scale, steps the
    optimizer inside accelerate's backward leaving no gradients, and ZeRO-3 leaves empty parameters (and empty
    copies): what the refusal says. Then the README's command under that launcher is refused (exit code 2)."""
    deepspeed = pytest.importorskip("deepspeed")
    result = launch_deepspeed(str(LIMITS_SCRIPT), str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["world_size"] == 2 and report["deepspeed"] == deepspeed.__version__
        assert report["distributed_type"] == "DistributedType.DEEPSPEED" and report["engine"] == "DeepSpeedEngine"
        assert report["clip_error"] and report["clip_error"] in DEEPSPEED_LIMITS["scalar"], report["clip_error"]
        assert report["params_changed_by_backward"] == report["params"] > 0  # the step happened inside backward
        assert report["grads_after_backward"] == 0
        assert report["zero3_full_numel"] > 0 and report["zero3_local_numel"] == report["zero3_copy_numel"] == 0
    refused = launch_deepspeed("recipes/train.py", "--config", "digits", f"output_dir={tmp_path / 'run'}")
    assert refused.returncode != 0
    assert "hf-ccl: error: accelerate launch with DeepSpeed (ACCELERATE_USE_DEEPSPEED) is not taken" in refused.stderr
    assert not (tmp_path / "run").exists()
