"""Config loading: YAML, overrides, and errors that list the valid choices before any training."""

import pytest

from hf_ccl.config import RunConfig, load_config
from hf_ccl.continual import ContinualArguments
from hf_ccl.run import check_config


def test_default_recipe_loads_with_overrides():
    config = load_config("recipes/configs/digits.yaml", ["training.learning_rate=1e-3", "methods=[joint]", "seed=3"])
    assert config.training["learning_rate"] == 1e-3
    assert config.training["per_device_train_batch_size"] == 64
    assert config.methods == ["joint"] and config.seed == 3


def test_unknown_config_key_lists_valid_ones(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("stream: digits\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="valid keys: stream, stream_args"):
        load_config(path)
    with pytest.raises(ValueError, match="Unknown config key 'epochs'"):
        load_config(None, ["epochs=3"])
    with pytest.raises(ValueError, match="not of the form key=value"):
        load_config(None, ["seed"])


def test_unknown_stream_method_and_model_option():
    with pytest.raises(ValueError, match="valid streams: .*digits"):
        check_config(RunConfig(stream="digitz"))
    with pytest.raises(ValueError, match="valid methods"):
        check_config(RunConfig(methods=["modx-typo"]))
    with pytest.raises(ValueError, match="valid options: data_root, seed, max_train_per_task.*label_space"):
        check_config(RunConfig(stream_args={"max_train_per_tsk": 3}))
    with pytest.raises(ValueError, match="Unknown model.config option"):
        RunConfig(model={"config": {"hiden_size": 3}})


def test_unknown_or_managed_training_option():
    with pytest.raises(ValueError, match="Unknown training option"):
        ContinualArguments(output_dir="x", training={"epochs": 3})
    with pytest.raises(ValueError, match="set by hf_ccl itself"):
        ContinualArguments(output_dir="x", training={"remove_unused_columns": True})


def test_every_shipped_recipe_passes_the_checks_made_before_training():
    """Each recipe in recipes/configs loads and its stream, methods and options are valid (nothing is trained)."""
    from pathlib import Path

    from hf_ccl.continual import ContinualArguments
    from hf_ccl.methods import build_methods
    from hf_ccl.run import check_config

    recipes = sorted(Path("recipes/configs").glob("*.yaml"))
    assert len(recipes) >= 9
    for path in recipes:
        config = load_config(path)
        check_config(config)
        build_methods(config.methods, config.method_args)
        ContinualArguments(output_dir="unused", training=dict(config.training), samples_per_task=config.samples_per_task,
                           warmup=config.warmup, first_task_epochs=config.first_task_epochs)
