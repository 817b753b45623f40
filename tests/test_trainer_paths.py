"""What `Trainer.training_step` does that `ContinualTrainer`'s step does not, refused before anything is built: one
process driving several GPUs (nn.DataParallel), DeepSpeed from the launcher, and a transformers release outside the
one the Trainer internals were checked against. (`training.deepspeed`, LOMO and `parallelism_config` are refused as
training options: tests/test_validation.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers
from transformers.training_args import ParallelMode

from hf_ccl.cli import main
from hf_ccl.distributed import NotDistributedError, check_distributed_trainer
from hf_ccl.training_options import CHECKED_TRANSFORMERS, check_transformers_version
from hf_ccl.validation import ConfigError


def test_one_process_on_several_gpus_is_refused_naming_the_split_batch():
    # what TrainingArguments reports in one process that sees 2 GPUs (no launcher): the Trainer would use DataParallel
    args = SimpleNamespace(parallel_mode=ParallelMode.NOT_DISTRIBUTED, n_gpu=2, world_size=1)
    with pytest.raises(NotDistributedError, match=r"sees 2 GPUs.*nn\.DataParallel.*each GPU.s part of the batch"):
        check_distributed_trainer(args)


def test_one_process_on_one_device_is_taken():
    check_distributed_trainer(SimpleNamespace(parallel_mode=ParallelMode.NOT_PARALLEL, n_gpu=1, world_size=1))


def test_deepspeed_from_the_launcher_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --use_deepspeed` sets
    code = main(["train", "--config", "digits", f"output_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "accelerate launch with DeepSpeed (ACCELERATE_USE_DEEPSPEED) is not taken" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("version", ["5.22.0", "5.24.0", "6.0.0", "4.57.1"])
def test_a_transformers_release_outside_the_checked_range_is_refused(version):
    low, high = CHECKED_TRANSFORMERS
    with pytest.raises(ConfigError, match=f"transformers {version} is installed.*>={low},<{high}"):
        check_transformers_version(version)


def test_the_installed_transformers_is_in_the_checked_range_and_so_is_a_patch_release():
    check_transformers_version()
    check_transformers_version(f"{CHECKED_TRANSFORMERS[0]}.7")
    assert transformers.__version__.startswith(CHECKED_TRANSFORMERS[0])
