"""One configuration: every `ContinualArguments` field is a config key (type, default and help taken from the loop
itself), settable from YAML and overrides; the bundled recipes give the loop the arguments they always gave; the CLI
checks a run once and builds its methods once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from hf_ccl.arguments import RENAMED_KEYS, SECTIONS
from hf_ccl.cli import main
from hf_ccl.config import (
    CONFIG_DEFAULTS,
    RunConfig,
    available_recipes,
    continual_fields,
    load_config,
    with_loop_fields,
)
from hf_ccl.continual import ContinualArguments
from hf_ccl.training_options import default_training
from hf_ccl.validation import ConfigError, type_hints

#: The `ContinualArguments` of the default config, as the config gave them before the loop's fields were derived.
DEFAULT_ARGS: dict[str, Any] = {
    "output_dir": "outputs/run",
    "training": {"num_train_epochs": 8, "per_device_train_batch_size": 64, "learning_rate": 0.001,
                 "weight_decay": 0.1, "warmup_steps": 0.1, "lr_scheduler_type": "cosine", "logging_steps": 10},
    "first_task_epochs": None, "max_length": None, "seed": 0, "save_checkpoints": True, "progress": True,
    "samples_per_task": None, "warmup": "every_task", "resume_from_checkpoint": None, "overwrite_output_dir": False,
    "keep_trainer_checkpoints": False, "resume_allow_changes": [], "image_cache": False,
    "classification_loss": "contrastive", "class_scope": "task",
    "evaluation": {"batch_size": 256, "initial": True, "every": 1, "max_examples": None, "cache": True},
    "hub": {"model_id": None, "private": False, "timeout": 60.0, "retries": 3, "backoff": 1.0},
    "card": {"license": None}, "diagnostics": {"spatial_disorder_task": None},
    "pairs": {"image_modalities": ["image"], "precomputed_modalities": []},
}
#: What each bundled recipe changes in them (`training`: the options it changes), recorded the same way.
RECIPE_ARGS: dict[str, dict[str, Any]] = {
    "c_clip-flickr8k-random5": {
        "output_dir": "outputs/c_clip-flickr8k-random5", "first_task_epochs": 10,
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0005,
                     "weight_decay": 0.2, "warmup_steps": 0.125, "adam_beta2": 0.99},
    },
    "cllclip-flickr8k-languages": {
        "output_dir": "outputs/cllclip-teir-flickr8k-languages",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 128, "learning_rate": 0.0005,
                     "weight_decay": 0.05},
    },
    "cmcl-pairs": {
        "output_dir": "outputs/cmcl-pairs",
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 64, "learning_rate": 0.0001,
                     "weight_decay": 0.001, "max_grad_norm": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 0},
    },
    "ctp-fashion-categories": {
        "output_dir": "outputs/ctp-fashion-categories", "first_task_epochs": 10,
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0001,
                     "weight_decay": 0.05, "warmup_steps": 0},
    },
    "custom-stream": {"output_dir": "outputs/custom-stream", "training": {"num_train_epochs": 3}},
    "digits": {"output_dir": "outputs/digits-finetune"},
    "domains5": {
        "output_dir": "outputs/domains5-finetune", "first_task_epochs": 10,
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0005},
    },
    "fashion-categories": {
        "output_dir": "outputs/fashion-categories-finetune", "first_task_epochs": 16,
        "training": {"per_device_train_batch_size": 128, "learning_rate": 0.0005},
    },
    "flickr8k-english": {
        "output_dir": "outputs/flickr8k-english",
        "training": {"num_train_epochs": 15, "per_device_train_batch_size": 128, "learning_rate": 0.0005},
    },
    "flickr8k-random5": {
        "output_dir": "outputs/flickr8k-random5-finetune", "first_task_epochs": 10,
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0005},
    },
    "modx-flickr8k-random5": {
        "output_dir": "outputs/modx-flickr8k-random5", "first_task_epochs": 10,
        "diagnostics": {"spatial_disorder_task": 0},
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0005,
                     "weight_decay": 0.2, "warmup_steps": 0.2, "adam_beta2": 0.99},
    },
    "pacs-domains": {
        "output_dir": "outputs/pacs-domains-finetune", "first_task_epochs": 10,
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 128, "learning_rate": 0.0005},
    },
    "cil-cifar100-b0inc10": {
        "output_dir": "outputs/finetune-cil-cifar100-b0inc10", "classification_loss": "cross_entropy", "class_scope": "seen",
        "training": {"num_train_epochs": 1, "per_device_train_batch_size": 128, "learning_rate": 1e-05},
    },
    "cil-cifar100-b50inc10": {
        "output_dir": "outputs/finetune-cil-cifar100-b50inc10", "classification_loss": "cross_entropy", "class_scope": "seen",
        "training": {"num_train_epochs": 1, "per_device_train_batch_size": 128, "learning_rate": 1e-05},
    },
    "cil-imagenet-r": {
        "output_dir": "outputs/finetune-cil-imagenet-r", "classification_loss": "cross_entropy", "class_scope": "seen",
        "training": {"num_train_epochs": 1, "per_device_train_batch_size": 128, "learning_rate": 1e-05},
    },
    "cil-caltech101-bundled": {
        "output_dir": "outputs/finetune-cil-caltech101-bundled", "classification_loss": "cross_entropy", "class_scope": "seen",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "er-mtil-bundled": {
        "output_dir": "outputs/er-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "finetune-mtil-bundled": {
        "output_dir": "outputs/finetune-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "lwf-mtil-bundled": {
        "output_dir": "outputs/lwf-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "diki-mtil-bundled": {
        "output_dir": "outputs/diki-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "optim": "sgd", "learning_rate": 5.0,
                     "weight_decay": 0.0, "warmup_steps": 0},
    },
    "lada-mtil-bundled": {
        "output_dir": "outputs/lada-mtil-bundled", "class_scope": "seen",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.001,
                     "weight_decay": 0.0, "warmup_steps": 0.1, "lr_scheduler_type": "cosine"},
    },
    "moe_adapters-mtil-bundled": {
        "output_dir": "outputs/moe_adapters-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.01},
    },
    "wise_ft-mtil-bundled": {
        "output_dir": "outputs/wise_ft-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "xtail": {
        "output_dir": "outputs/finetune-xtail", "classification_loss": "cross_entropy", "class_scope": "all",
        "training": {"num_train_epochs": 10, "per_device_train_batch_size": 32, "learning_rate": 1e-05},
    },
    "xtail-bundled": {
        "output_dir": "outputs/finetune-xtail-bundled", "classification_loss": "cross_entropy",
        "class_scope": "all",
        "training": {"num_train_epochs": 5, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "condu-mtil-bundled": {
        "output_dir": "outputs/condu-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "zscl-mtil-bundled": {
        "output_dir": "outputs/zscl-mtil-bundled", "classification_loss": "cross_entropy",
        "training": {"num_train_epochs": 3, "per_device_train_batch_size": 64, "learning_rate": 0.0005},
    },
    "tic-fashion-years": {
        "output_dir": "outputs/tic-fashion-years-cumulative_all",
        "evaluation": {**DEFAULT_ARGS["evaluation"], "initial": False},
        "samples_per_task": 4096, "warmup": "first_task",
        "training": {"learning_rate": 0.0005, "weight_decay": 0.2, "warmup_steps": 8, "adam_beta2": 0.98,
                     "adam_epsilon": 1e-06},
    },
}


def _typed(value: Any) -> Any:
    """A value with the type of every leaf, so that 8 and 8.0 (or 1e-3 and "1e-3") differ."""
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    return (type(value).__name__, value)


def test_every_bundled_recipe_gives_the_loop_the_same_arguments_as_before():
    recipes = available_recipes()
    assert sorted(recipes) == sorted(RECIPE_ARGS) == sorted(p.stem for p in Path("recipes/configs").glob("*.yaml"))
    for name, path in recipes.items():
        changes = dict(RECIPE_ARGS[name])
        expected = {**DEFAULT_ARGS, **changes, "training": {**DEFAULT_ARGS["training"], **changes.get("training", {})}}
        for source in (name, path, Path("recipes/configs") / path.name):
            args = load_config(source).continual_arguments()
            assert type(args) is ContinualArguments
            assert _typed(dataclasses.asdict(args)) == _typed(expected), (name, source)


def test_every_loop_field_is_a_config_key_with_its_type_default_and_help():
    """Derived from `dataclasses.fields(ContinualArguments)`: nothing to copy by hand, nothing to forget."""
    loop = [f for f in dataclasses.fields(ContinualArguments) if f.init]
    config = {f.name: f for f in dataclasses.fields(RunConfig)}
    loop_hints, config_hints = type_hints(ContinualArguments), type_hints(RunConfig)
    assert continual_fields() == [f.name for f in loop]
    for item in loop:
        assert config_hints[item.name] == loop_hints[item.name], item.name
        assert config[item.name].metadata["help"] == item.metadata["help"], item.name
        if item.name not in CONFIG_DEFAULTS:
            assert getattr(RunConfig(), item.name) == getattr(ContinualArguments(output_dir="x"), item.name)
    assert set(CONFIG_DEFAULTS) <= {f.name for f in loop}


def test_a_run_field_cannot_hide_a_loop_field_and_a_loop_field_without_default_is_required(monkeypatch):
    class Clash:
        seed: int = 1

    with pytest.raises(TypeError, match="Clash.seed would hide ContinualArguments.seed"):
        with_loop_fields(Clash)
    monkeypatch.delitem(CONFIG_DEFAULTS, "output_dir")  # as a new loop field without a default would be

    @dataclasses.dataclass
    @with_loop_fields
    class Config:
        stream: str = "digits"

    assert [f.name for f in dataclasses.fields(Config)] == ["stream", *continual_fields()]
    with pytest.raises(TypeError, match="output_dir"):
        Config()
    assert Config(output_dir="x").output_dir == "x"


#: Values that the generic rule below cannot guess (a choice, a Hub id, a setting that needs another one).
SPECIAL: dict[str, tuple[Any, dict[str, Any]]] = {
    "output_dir": ("outputs/elsewhere", {}),
    "training": ({"num_train_epochs": 2, "learning_rate": 0.01}, {}),
    "warmup": ("first_task", {}),
    "hub": ({"model_id": "someone/clip", "private": True, "timeout": 5.0, "retries": 1, "backoff": 0.5}, {}),
    "card": ({"license": "mit"}, {}),
    "evaluation": ({"batch_size": 64, "initial": False, "every": 2, "max_examples": 8, "cache": False}, {}),
    "diagnostics": ({"spatial_disorder_task": 1}, {}),
    "resume_from_checkpoint": ("auto", {}),
    "resume_allow_changes": (["training.learning_rate"], {"resume_from_checkpoint": "auto"}),
    "samples_per_task": (512, {}),
    "pairs": ({"image_modalities": ["image", "sketch"], "precomputed_modalities": ["audio"]}, {}),
    "classification_loss": ("cross_entropy", {}),
    "class_scope": ("seen", {}),
}


def _other_value(item: dataclasses.Field, annotation: Any) -> Any:
    """A valid value other than the default, by type."""
    default = getattr(RunConfig(), item.name)
    if isinstance(default, bool):
        return not default
    if annotation in (int, int | None):
        return (default or 0) + 2
    if annotation in (float, float | None):
        return (default or 1.0) * 2.5
    raise AssertionError(f"no test value for the new field {item.name!r} ({annotation}): add one to SPECIAL")


@pytest.mark.parametrize("item", [f for f in dataclasses.fields(ContinualArguments) if f.init], ids=lambda f: f.name)
def test_every_loop_field_is_settable_from_yaml_and_from_an_override(tmp_path, item):
    hints = type_hints(ContinualArguments)
    value, companions = SPECIAL.get(item.name) or (_other_value(item, hints[item.name]), {})
    assert value != getattr(RunConfig(), item.name)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({item.name: value, **companions}))
    from_yaml = load_config(path).continual_arguments()
    overrides = [f"{key}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for key, v in {item.name: value, **companions}.items()]
    from_override = load_config("digits", overrides).continual_arguments()
    if item.name == "training":  # a training section, from YAML, an override or Python, extends the defaults
        value = {**default_training(), **value}
    if item.name in SECTIONS:  # a section: its dataclass, the same from YAML, an override or Python
        value = SECTIONS[item.name](**value)
        dotted = [f"{item.name}.{key}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                  for key, v in dataclasses.asdict(value).items()]
        assert load_config("digits", dotted).continual_arguments() == from_override  # key by key: the same
    assert getattr(from_override, item.name) == value  # an override replaces the value
    assert getattr(from_yaml, item.name) == value


def test_a_loop_field_is_checked_as_the_loop_checks_it():
    with pytest.raises(ConfigError, match="hub.backoff must be a number, got 'slow'"):
        load_config(None, ["hub.backoff=slow"])
    with pytest.raises(ConfigError, match=r"hub.backoff must be >= 0, got -1 \(in the overrides\)"):
        load_config(None, ["hub.backoff=-1"])
    with pytest.raises(ConfigError, match="keep_trainer_checkpoints must be true or false"):
        RunConfig(keep_trainer_checkpoints="often")
    with pytest.raises(ConfigError, match="Unknown config key 'hub_retry_backof' in an override; valid keys: stream, "
                       r"stream_args, .*, hub, card, diagnostics, pairs$"):
        load_config(None, ["hub_retry_backof=2"])
    with pytest.raises(ConfigError, match=r"Unknown hub option\(s\) \['retry_backoff'\]; valid: model_id, private, "
                       r"timeout, retries, backoff \(in the overrides\)"):
        load_config(None, ["hub.retry_backoff=2"])


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_a_key_of_an_earlier_version_is_refused_naming_its_new_key(tmp_path, old):
    new = RENAMED_KEYS[old]
    with pytest.raises(ConfigError, match=f"^{old} is now {new}$"):
        load_config(None, [f"{old}=1"])
    path = tmp_path / "old.yaml"
    path.write_text(f"{old}: 1\n")
    with pytest.raises(ConfigError, match=f"^{old} is now {new}$"):
        load_config(path)


def test_a_renamed_key_on_the_command_line_exits_2_naming_the_new_key(tmp_path, capsys):
    assert main(["train", f"output_dir={tmp_path / 'run'}", "hub_model_id=me/run"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "hf-ccl: error: hub_model_id is now hub.model_id"
    assert not (tmp_path / "run").exists()


def test_a_section_from_python_is_its_dataclass_or_a_dict():
    from hf_ccl import HubArguments

    given = ContinualArguments(output_dir="x", hub=HubArguments(model_id="me/run"), evaluation={"batch_size": 8})
    assert given.hub == HubArguments(model_id="me/run") and given.evaluation.batch_size == 8
    with pytest.raises(ConfigError, match=r"^evaluation.every must be >= 1, got 0$"):
        ContinualArguments(output_dir="x", evaluation={"every": 0})
    with pytest.raises(ConfigError, match=r"^Unknown card option\(s\) \['licence'\]; valid: license$"):
        ContinualArguments(output_dir="x", card={"licence": "mit"})


def test_train_help_lists_every_config_key_with_its_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for item in dataclasses.fields(RunConfig):
        assert f"{item.name}: " in out, item.name
        assert " ".join(item.metadata["help"].split())[:40] in out, item.name
    assert "hub.backoff: a number (default 1.0)" in out
    for name, section in SECTIONS.items():
        for item in dataclasses.fields(section):
            assert f"{name}.{item.name}: " in out, (name, item.name)
            assert " ".join(item.metadata["help"].split())[:40] in out, (name, item.name)


def test_the_cli_checks_a_run_once_and_builds_its_methods_once(tmp_path, monkeypatch, capsys):
    """`hf-ccl train` (and recipes/train.py): one check of the config, the stream spec and the methods; the run
    uses the methods and arguments that were checked."""
    import hf_ccl.run

    calls: dict[str, int] = {"build_methods": 0, "check_stream_spec": 0, "validate": 0}

    def counted(name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    for name in ("build_methods", "check_stream_spec"):
        monkeypatch.setattr(hf_ccl.run, name, counted(name, getattr(hf_ccl.run, name)))
    monkeypatch.setattr(RunConfig, "validate", counted("validate", RunConfig.validate))
    seen: dict[str, Any] = {}

    class Learner:  # stands in for ContinualLearner: records what the run hands it
        compute = None
        push_report = None

        def __init__(self, model: Any, stream: Any, methods: Any, image_processor: Any, tokenizer: Any,
                     args: ContinualArguments, plan: Any = None) -> None:
            seen.update(methods=methods, args=args, plan=plan)

        def claim_output_dir(self, lock: Any = None) -> None:
            Path(seen["args"].output_dir).mkdir(parents=True, exist_ok=True)  # (run() locked it: it exists)

        def fit(self) -> Any:
            return type("Results", (), {"to_markdown": lambda self: "| matrix |"})()

    monkeypatch.setattr(hf_ccl.run, "ContinualLearner", Learner)
    monkeypatch.setattr(hf_ccl.run, "build_run_stream", lambda config: "stream")
    monkeypatch.setattr(hf_ccl.run, "load_model", lambda config: "model")
    monkeypatch.setattr(hf_ccl.run, "load_processors", lambda config, model: ("images", "tokenizer"))
    output_dir = tmp_path / "run"
    code = main(["train", "--config", "custom-stream", f"output_dir={output_dir}", "hub.backoff=0.5",
                 "methods=[er]"])
    assert code == 0, capsys.readouterr().err
    assert calls == {"build_methods": 1, "check_stream_spec": 1, "validate": 1}  # load_config's, reused by the check
    assert [method.name for method in seen["methods"]] == ["er"]
    assert seen["plan"].covers(seen["args"], seen["methods"])  # so the learner does not check them again
    assert seen["args"].hub.backoff == 0.5 and seen["args"].output_dir == str(output_dir)
    assert yaml.safe_load((output_dir / "run_config.yaml").read_text())["hub"]["backoff"] == 0.5
