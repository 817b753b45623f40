"""Config loading: YAML, overrides, and errors that list the valid choices before any training."""

from pathlib import Path

import pytest

from hf_ccl.config import RunConfig, available_recipes, load_config
from hf_ccl.continual import ContinualArguments
from hf_ccl.run import check_config, looks_local
from hf_ccl.safe_yaml import load_yaml


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
    with pytest.raises(ValueError, match="training.remove_unused_columns is not taken: hf_ccl sets it"):
        ContinualArguments(output_dir="x", training={"remove_unused_columns": True})


#: Shipped recipes that need a value from the user (a commit that could not be read offline), and the refusal.
NEEDS_A_VALUE = {"cil-imagenet-r": "stream_args: revision must be the full 40-character commit SHA"}


def test_every_shipped_recipe_passes_the_checks_made_before_training(tmp_path, monkeypatch):
    """Each recipe shipped in the package (hf_ccl/recipes, also recipes/configs in a checkout) loads by name and by
    path, and its stream, methods, options and combination are valid (nothing is built or trained). A recipe that
    starts from another recipe's checkpoint fails its path check until that recipe has run, naming the folder.
    The relative paths are checked from an empty folder: a checkout where `make run` already wrote
    outputs/digits-finetune would otherwise (rightly) refuse that recipe as "holds another run"."""
    recipes = available_recipes()
    assert len(recipes) >= 11
    shipped = Path("recipes/configs").resolve()
    assert sorted(p.name for p in shipped.glob("*.yaml")) == sorted(p.name for p in recipes.values())
    monkeypatch.chdir(tmp_path)
    for name, path in recipes.items():
        config = load_config(name)
        assert config == load_config(shipped / path.name)
        if name in NEEDS_A_VALUE:  # a value only the user can give: refused, naming it
            with pytest.raises(ValueError, match=NEEDS_A_VALUE[name]):
                check_config(config, check_paths=False)
            continue
        check_config(config, check_paths=False)
        pretrained = config.model["pretrained"]
        if pretrained is not None and looks_local(pretrained) and not Path(pretrained).exists():  # cllclip-flickr8k-languages: run flickr8k-english first
            with pytest.raises(ValueError, match=f"model.pretrained: no such folder '{pretrained}'"):
                check_config(config)
        else:
            check_config(config)


def _laughs(levels: int = 9) -> str:
    """A flow list whose last item is a 'billion laughs': level k is 9 aliases of level k-1 (9^levels values)."""
    names = [f"l{k}" for k in range(levels)]
    items = [f"&{names[0]} [x, x, x, x, x, x, x, x, x]"]
    items += [f"&{name} [{', '.join([f'*{previous}'] * 9)}]" for previous, name in zip(names[:-1], names[1:], strict=True)]
    return f"[{', '.join(items)}]"


def test_a_yaml_alias_bomb_is_refused_while_the_config_is_read(tmp_path, capsys):
    """In a config file or an override value, as a user writes it: refused at once (exit 2), one line, nothing
    written; aliases that expand to a sane size still work."""
    import time

    from hf_ccl.cli import main

    path = tmp_path / "laughs.yaml"
    path.write_text(f"stream: digits\noutput_dir: {tmp_path / 'run'}\ntraining:\n  report_to: {_laughs()}\n")
    started = time.perf_counter()
    assert main(["train", "--config", str(path)]) == 2
    assert main(["train", f"output_dir={tmp_path / 'run'}", f"training.report_to={_laughs()}"]) == 2
    assert main(["train", f"output_dir={tmp_path / 'run'}", "training.report_to=&loop [*loop]"]) == 2
    assert time.perf_counter() - started < 5
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("hf-ccl: error: ") for line in lines), lines
    assert lines[0].startswith(f"hf-ccl: error: {path}: its YAML aliases (*name) expand to more than 1,000,000")
    assert lines[1].startswith("hf-ccl: error: Override of training.report_to: its YAML aliases")
    assert "contains it" in lines[2] and not (tmp_path / "run").exists()
    path.write_text("stream: digits\nmethods: &m [finetune]\ntraining: {learning_rate: &lr 0.01, max_grad_norm: *lr}\n")
    config = load_config(path)
    assert config.methods == ["finetune"] and config.training["max_grad_norm"] == 0.01
    assert len(load_yaml(_laughs(4), "test")[-1][0][0][0]) == 9  # 9^4 values: fine
