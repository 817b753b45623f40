"""What a config does as a user gives it: the same training defaults from Python, YAML and the command line; no
token anywhere in a config; steps that cannot train as asked refused before training; task names that fit a card."""

from __future__ import annotations

import errno

import pytest

from hf_ccl.cli import disk_full, main
from hf_ccl.config import load_config
from hf_ccl.continual import ContinualArguments, planned_steps
from hf_ccl.data.task import Task
from hf_ccl.training_options import default_training
from hf_ccl.validation import ConfigError

TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
TINY = ["progress=false", "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=10",
        "model.config.hidden_size=32", "model.config.num_layers=1", "training.per_device_train_batch_size=16"]


# ----- training defaults --------------------------------------------------------------------------------------------
def test_python_yaml_and_the_command_line_share_the_training_defaults(tmp_path):
    given = {"num_train_epochs": 3, "learning_rate": 1e-3}
    python = ContinualArguments(output_dir=str(tmp_path), training=dict(given)).training
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  num_train_epochs: 3\n  learning_rate: 1.0e-3\n")
    from_yaml = load_config(str(config)).training
    override = load_config(None, ["training={num_train_epochs: 3, learning_rate: 1.0e-3}"]).training
    expected = {**default_training(), **given}
    assert python == from_yaml == override == expected
    assert ContinualArguments(output_dir=str(tmp_path)).training == default_training()
    assert python["per_device_train_batch_size"] == 64 and python["lr_scheduler_type"] == "cosine"


def test_a_schedule_without_warmup_drops_the_default_warmup_but_refuses_a_given_one(tmp_path):
    constant = ContinualArguments(output_dir=str(tmp_path), training={"lr_scheduler_type": "constant"}).training
    assert "warmup_steps" not in constant
    with pytest.raises(ConfigError, match="training.warmup_steps has no effect"):
        ContinualArguments(output_dir=str(tmp_path), training={"lr_scheduler_type": "constant", "warmup_steps": 5})


# ----- tokens -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override", [
    f"hub.model_id=someone/{TOKEN}", f"card.license={TOKEN}", f"training.run_name={TOKEN}",
    f"model.pretrained={TOKEN}", f"method_args.er.{TOKEN}=1", f"stream_args.note=x{TOKEN}x",
])
def test_a_token_anywhere_in_a_config_is_refused_without_echoing_it(tmp_path, capsys, override):
    output_dir = tmp_path / "run"
    assert main(["train", "--config", "digits", f"output_dir={output_dir}", override]) == 2
    err = capsys.readouterr().err
    assert TOKEN not in err and "looks like a Hugging Face token" in err
    assert not output_dir.exists()


def test_a_token_given_in_python_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="hub.model_id holds what looks like a Hugging Face token") as raised:
        ContinualArguments(output_dir=str(tmp_path), hub={"model_id": f"me/{TOKEN}"})
    assert TOKEN not in str(raised.value)


def test_hf_ccl_push_refuses_a_token_as_repository(tmp_path, capsys):
    assert main(["push", str(tmp_path), "--repo", TOKEN]) == 2
    assert TOKEN not in capsys.readouterr().err


# ----- steps known before training ----------------------------------------------------------------------------------
def test_planned_steps_count_as_the_trainer_does():
    assert planned_steps(20, {"num_train_epochs": 2, "per_device_train_batch_size": 8}) == 6  # 3 batches x 2
    assert planned_steps(20, {"num_train_epochs": 1, "per_device_train_batch_size": 8,
                              "dataloader_drop_last": True}) == 2
    assert planned_steps(20, {"num_train_epochs": 1, "per_device_train_batch_size": 4,
                              "gradient_accumulation_steps": 2}) == 3  # 5 batches: 2 whole steps and a partial one
    assert planned_steps(20, {"max_steps": 7}) == 7
    assert planned_steps(20, {"num_train_epochs": 1, "per_device_train_batch_size": 4}, processes=3) == 2  # 7 rows


def test_a_weight_ensemble_longer_than_every_task_is_refused_before_training(tmp_path, capsys):
    output_dir = tmp_path / "run"
    code = main(["train", "--config", "digits", *TINY, "methods=[weight_ensemble]", "training.max_steps=3",
                 "method_args.weight_ensemble.every=5", f"output_dir={output_dir}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "Task 0 ('digits-01') trains 3 optimizer step(s)" in err and "method_args.weight_ensemble.every=5" in err
    assert not list(output_dir.glob("task-*")) and not (output_dir / "trainer").exists()


def test_a_one_step_task_whose_warmup_takes_it_is_refused(tmp_path, capsys):
    output_dir = tmp_path / "run"
    assert main(["train", "--config", "digits", *TINY, "training.max_steps=1", f"output_dir={output_dir}"]) == 1
    assert "its warmup (training.warmup_steps=0.1) takes it" in capsys.readouterr().err
    assert not list(output_dir.glob("task-*"))
    assert main(["train", "--config", "digits", *TINY, "training.max_steps=1", "training.warmup_steps=0",
                 "stream_args.max_train_per_task=16", f"output_dir={output_dir}"]) == 0


# ----- names, disks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a\nb", "", "tab\there"])
def test_a_task_name_must_be_one_printable_line(name):
    from datasets import Dataset

    rows = Dataset.from_dict({"image": [], "text": [], "label": [], "image_id": []})
    with pytest.raises(ValueError, match="must be a non-empty line of printable text"):
        Task(name=name, train=rows, eval=rows)


def test_a_read_only_disk_is_not_reported_as_full(tmp_path):
    read_only = OSError(errno.EROFS, "Read-only file system")
    assert disk_full(read_only, str(tmp_path)) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "no space left" in disk_full(full, str(tmp_path))


def test_a_yaml_no_is_taken_as_the_choice_no():
    """YAML 1.1 reads `no` as false: for a field that takes "no" (`save_strategy`), it means "no"."""
    assert load_config(None, ["training.save_strategy=no"]).training["save_strategy"] == "no"
    with pytest.raises(ConfigError, match="training.lr_scheduler_type"):
        load_config(None, ["training.lr_scheduler_type=no"])
