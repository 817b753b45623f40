"""FSDP: refused before anything is built, with the limit that stops it (`hf_ccl.training_options.check_fsdp`).

One two-process launch (`tests/scripts/fsdp_limits.py`, gloo on CPU) re-checks each limit the refusal names, so this
test fails, and the refusal is revisited, as soon as a torch / accelerate / transformers release lifts one."""

import json

import pytest
from test_distributed import SCRIPT as DISTRIBUTED_SCRIPT
from test_distributed import launch_two_processes

from hf_ccl.continual import ContinualArguments
from hf_ccl.training_options import FSDP_LIMITS
from hf_ccl.validation import ConfigError

LIMITS_SCRIPT = DISTRIBUTED_SCRIPT.parent / "fsdp_limits.py"


@pytest.mark.parametrize(
    ("training", "version"),
    [({"fsdp": True}, "2"), ({"fsdp": "full_shard"}, "2"), ({"fsdp": True, "fsdp_config": {"version": 2}}, "2"),
     ({"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_version": 1}}, "1")],
)
def test_training_fsdp_is_refused_with_its_limit(tmp_path, training, version):
    with pytest.raises(ConfigError, match=f"training.fsdp: FSDP{version} cannot train") as raised:
        ContinualArguments(output_dir=str(tmp_path), training=training)
    message = str(raised.value)
    assert FSDP_LIMITS[version] in message
    assert "main process alone" in message and "accelerate launch --multi_gpu" in message
    assert "drops its FSDP plugin" in message  # this machine has no GPU: FSDP would silently be DDP
    assert raised.value.key == "training.fsdp"


def test_fsdp_from_the_launcher_is_refused(tmp_path, monkeypatch):
    """`accelerate launch --use_fsdp` / a config file with `distributed_type: FSDP` reach the Trainer through the
    environment; the run is refused all the same, by the version the launcher asks for."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError, match=r"accelerate launch with FSDP \(ACCELERATE_USE_FSDP\): FSDP2") as raised:
        ContinualArguments(output_dir=str(tmp_path))
    assert FSDP_LIMITS["2"] in str(raised.value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    ContinualArguments(output_dir=str(tmp_path))


def test_fsdp_options_without_fsdp_and_unknown_versions_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="training.fsdp_config has no effect without training.fsdp"):
        ContinualArguments(output_dir=str(tmp_path), training={"fsdp_config": {"version": 2}})
    with pytest.raises(ConfigError, match="FSDP version '3' does not exist"):
        ContinualArguments(output_dir=str(tmp_path), training={"fsdp": True, "fsdp_config": {"version": 3}})
    ContinualArguments(output_dir=str(tmp_path), training={"fsdp": False})  # off is fine


@pytest.mark.slow  # two processes, ~25 s (CI time); the refusals themselves are tested above
@pytest.mark.multiprocess
def test_the_limits_still_hold_on_two_cpu_processes(tmp_path):
    """FSDP2 itself runs on gloo (an MLP shards, steps and gathers), but it refuses a CLIP (scalar logit_scale), and
    accelerate drops its FSDP plugin on CPU and cannot build an FSDP1 plugin there: what the refusal says."""
    launch_two_processes(LIMITS_SCRIPT, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2
        assert report["mlp_dtensor"] and report["mlp_local_rows"] == 4  # 8 rows sharded over 2 processes
        assert report["mlp_full_keys"] == (["0.bias", "0.weight", "1.bias", "1.weight"] if rank == 0 else [])
        assert report["clip_error"] and report["clip_error"] in FSDP_LIMITS["2"], report["clip_error"]
        assert report["distributed_type"] == "DistributedType.MULTI_CPU" and not report["fsdp_plugin_kept"]
        assert "no available devices" in report["fsdp1_error"]
