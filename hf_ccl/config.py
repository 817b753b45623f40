"""Run configuration: one YAML file (read with a safe loader, aliases bounded: `hf_ccl.safe_yaml`) plus command-line overrides `key.sub=value`.

Import-light (no torch or transformers at module level): `hf-ccl train --help` lists every key from here."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .arguments import SECTIONS, ContinualArguments, check_renamed_keys
from .catalog import family_names
from .files import write_text_atomic
from .safe_yaml import YAMLSizeError, load_yaml
from .validation import (
    ConfigError,
    check_dataclass,
    check_mapping,
    check_no_tokens,
    check_range,
    check_value,
    describe,
    known_keys,
    type_hints,
)

#: The config's own defaults of loop fields, where a run needs another than the loop's: a run folder. (The
#: training section's defaults are the loop's, `hf_ccl.training_options.default_training`, which a given section
#: extends, from YAML, the command line and Python alike.)
CONFIG_DEFAULTS: dict[str, Callable[[], Any]] = {"output_dir": lambda: "outputs/run"}
#: The model families, for the help of `model`, read from families.py's source (`hf_ccl.families.FAMILIES` imports
#: torch; a test keeps them equal).
FAMILY_NAMES = family_names()


def with_loop_fields(cls: type) -> type:
    """Class decorator, applied before `@dataclass`: add every init field of `ContinualArguments` to `cls` after
    its own fields, with the loop's type, default (`CONFIG_DEFAULTS` replaces one) and help. A field of the loop
    without a default becomes a required keyword. A field of `cls` that has the name of a loop field is an error:
    it would hide the loop's field."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    hints = type_hints(ContinualArguments)
    for item in dataclasses.fields(ContinualArguments):
        if not item.init:
            continue
        if item.name in annotations:
            raise TypeError(f"{cls.__name__}.{item.name} would hide ContinualArguments.{item.name}: rename it")
        if item.name in CONFIG_DEFAULTS:
            spec: Any = field(default_factory=CONFIG_DEFAULTS[item.name], metadata=item.metadata)
        elif item.default is not dataclasses.MISSING:
            spec = field(default=item.default, metadata=item.metadata)
        elif item.default_factory is not dataclasses.MISSING:
            spec = field(default_factory=item.default_factory, metadata=item.metadata)
        else:
            spec = field(kw_only=True, metadata=item.metadata)
        annotations[item.name] = hints[item.name]
        setattr(cls, item.name, spec)
    cls.__annotations__ = annotations
    return cls


@dataclass
@with_loop_fields
class RunConfig:
    """Everything a continual run needs: the stream, the model and the methods (the fields below), then every field
    of `ContinualArguments` (the loop's arguments: output_dir, training, seed, ...; added by `with_loop_fields`, so a
    new loop field is a config key with nothing to copy). Every field is a YAML key and can be overridden on the
    command line (`training.learning_rate=1e-3`); `hf-ccl train --help` lists them."""

    stream: str | dict[str, Any] = field(
        default="digits",
        metadata={"help": "A named stream (see `hf-ccl list`), or a mapping {builder: by_column|random_split|...}."},
    )
    stream_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Options of the stream builder: max_train_per_task, max_eval_per_task, validate_images."},
    )
    data_root: str | None = field(
        default=None, metadata={"help": "Folder of the HF dataset folders; default $HF_CCL_DATA_ROOT or ../shared/datasets."}
    )
    methods: list[str] = field(default_factory=lambda: ["finetune"], metadata={"help": "Methods, composed in order."})
    method_args: dict[str, dict[str, Any]] = field(default_factory=dict, metadata={"help": "{method: {option: value}}."})
    model: dict[str, Any] = field(
        default_factory=lambda: {"pretrained": None, "config": {}},
        metadata={"help": "pretrained: checkpoint path or Hub id; else config: tiny_config() options of a random model; "
                          f"family: one of {', '.join(FAMILY_NAMES)} (default: the checkpoint's, or clip)."},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path; default the checkpoint's, else the real CLIP BPE."}
    )
    if TYPE_CHECKING:  # loop fields read through a RunConfig (`with_loop_fields` adds them all), for the checker
        output_dir: str = field(kw_only=True)
        seed: int = field(kw_only=True)
        resume_from_checkpoint: bool | str | None = field(kw_only=True)
        overwrite_output_dir: bool = field(kw_only=True)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> ContinualArguments:
        """Check the type of every value of the run's own fields, the model section, and the loop's fields as
        `ContinualArguments` checks them (ranges, consistency, the `training` section and the sections); converted
        values are stored back. Returns the loop's arguments so checked. Streams, methods and paths are checked by
        `hf_ccl.run.check_config`, before anything is built."""
        check_no_tokens(self)  # before any value is echoed in an error or written
        if isinstance(self.methods, str):
            self.methods = [self.methods]
        if isinstance(self.method_args, dict):  # `name:` with no options reads as null in YAML
            self.method_args = {name: options or {} for name, options in self.method_args.items()}
        check_dataclass(self, names=run_fields())
        known_keys(self.model, MODEL_KEYS, "model option(s)")
        self.model = {"pretrained": None, "config": {}, "family": None, **self.model}
        check_value("model.pretrained", self.model["pretrained"], str | None)
        family = check_value("model.family", self.model["family"], str | None)
        if family is not None:
            from .families import family_of

            try:
                family_of(family)
            except ValueError as error:
                raise ConfigError(f"model.family: {error}", "model.family") from None
        model_config = check_value("model.config", self.model["config"], dict[str, Any] | None) or {}
        from .modeling import tiny_clip_config

        known_keys(model_config, list(inspect.signature(tiny_clip_config).parameters), "model.config option(s)")
        self.model["config"] = check_mapping(model_config, type_hints(tiny_clip_config), "model.config.")
        check_model_config(self.model["config"], family or "clip")
        if self.model["pretrained"] is not None and self.model["config"]:
            raise ConfigError("model.config describes a random model and has no effect with model.pretrained: "
                              "remove one of them (override model.config={} to keep the checkpoint)")
        args = self.continual_arguments()  # ranges, the training section and the sections; converted values back
        for name in continual_fields():
            setattr(self, name, copy.deepcopy(getattr(args, name)))
        self._checked = (self.to_dict(), args)
        return args

    def checked_arguments(self) -> ContinualArguments:
        """The loop's arguments as `validate` made them, validating again only when a value changed since."""
        checked = getattr(self, "_checked", None)
        if checked is not None and checked[0] == self.to_dict():
            return checked[1]
        return self.validate()

    def continual_arguments(self) -> ContinualArguments:
        """The `ContinualArguments` of this run (a copy of every loop field, checked)."""
        return ContinualArguments(**{name: copy.deepcopy(getattr(self, name)) for name in continual_fields()})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MODEL_KEYS = ("pretrained", "config", "family")


def continual_fields() -> list[str]:
    """The loop's fields, each a `RunConfig` field too (`with_loop_fields`), in `ContinualArguments`' order."""
    return [item.name for item in dataclasses.fields(ContinualArguments) if item.init]


def check_model_config(values: dict[str, Any], family: str = "clip") -> None:
    """Ranges of `tiny_config` options (those given), and what the family needs of them."""
    for key, value in values.items():
        if not key.endswith("_token_id"):
            check_range(f"model.config.{key}", value, 1)
    hidden, heads = values.get("hidden_size", 64), values.get("num_heads", 2)
    if hidden % heads:
        raise ConfigError(f"model.config.hidden_size ({hidden}) must be a multiple of model.config.num_heads ({heads})")
    image, patch = values.get("image_size", 32), values.get("patch_size", 8)
    if patch > image:
        raise ConfigError(f"model.config.patch_size ({patch}) must not exceed model.config.image_size ({image})")
    projection = values.get("projection_dim", 64)
    if family in ("siglip", "siglip2") and projection != hidden:
        raise ConfigError(f"model.config.projection_dim ({projection}) must equal model.config.hidden_size ({hidden}): "
                          "a SigLIP embeds into its hidden size", "model.config.projection_dim")


def run_fields() -> list[str]:
    """The run's own config keys (stream, model, methods, ...), without the loop's."""
    loop = set(continual_fields())
    return [item.name for item in dataclasses.fields(RunConfig) if item.name not in loop]


def config_fields() -> list[str]:
    """Every config key: the run's own, then the loop's."""
    return [f.name for f in dataclasses.fields(RunConfig)]


def required_fields() -> list[str]:
    """Config keys without a default (a loop field that has none and no `CONFIG_DEFAULTS` entry)."""
    return [f.name for f in dataclasses.fields(RunConfig)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def default_value(item: dataclasses.Field) -> Any:
    """The default of a config field (`dataclasses.MISSING` when it has none)."""
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def config_keys_help(width: int = 100) -> str:
    """Every config key with what it takes, its default and its help, for `hf-ccl train --help`."""
    lines = ["config keys (YAML keys of --config, or overrides key=value / section.key=value):"]
    for name, item, hint in _help_fields(RunConfig):
        if name in SECTIONS:
            lines.append(f"  {name}: a section ({', '.join(f.name for f in dataclasses.fields(SECTIONS[name]))})")
            lines += _wrapped(item.metadata.get("help", ""), width)
            for key, sub, sub_hint in _help_fields(SECTIONS[name]):
                lines.append(f"    {name}.{key}: {_shown(sub_hint, default_value(sub))}")
                lines += _wrapped(sub.metadata.get("help", ""), width, 8)
            continue
        lines.append(f"  {name}: {_shown(hint, default_value(item))}")
        lines += _wrapped(item.metadata.get("help", ""), width)
    return "\n".join(lines)


def _help_fields(cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    hints = type_hints(cls)
    return [(item.name, item, hints[item.name]) for item in dataclasses.fields(cls) if item.init]


def _shown(hint: Any, default: Any) -> str:
    """What a key takes and its default: "a number (default 1.0)"."""
    return f"{describe(hint)} ({'required' if default is dataclasses.MISSING else f'default {yaml_text(default)}'})"


def _wrapped(text: str, width: int, indent: int = 6) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=" " * indent, subsequent_indent=" " * indent,
                         break_on_hyphens=False)


def yaml_text(value: Any) -> str:
    """A value as one line of YAML (`null`, `[]`, `{num_train_epochs: 8, ...}`)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix("...").strip()


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.learning_rate=1e-3` -> (["training", "learning_rate"], 0.001); values are YAML."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"Override {text!r} is not of the form key=value (e.g. training.num_train_epochs=2)")
    try:
        parsed = load_yaml(value, f"Override of {key}") if value.strip() else None
    except YAMLSizeError as error:
        raise ConfigError(str(error), key) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"Override of {key}: the value is not valid YAML ({error.__class__.__name__}); quote "
                          "it, e.g. key='value'") from error
    if isinstance(parsed, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return key.split("."), parsed


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted keys in a nested dict; the top-level key must be a RunConfig field."""
    valid = config_fields()
    for text in overrides:
        path, value = parse_override(text)
        check_renamed_keys([path[0]])
        if path[0] not in valid:  # never the value: it may be a secret typed in the wrong place
            raise ConfigError(f"Unknown config key {path[0]!r} in an override; valid keys: {', '.join(valid)}")
        target = values
        for depth, part in enumerate(path[:-1]):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise ConfigError(f"Override of {'.'.join(path)}: {'.'.join(path[: depth + 1])} is not a section")
            target = target[part]
        target[path[-1]] = value
    return values


RECIPE_SUFFIX = ".yaml"


def recipes_folder() -> Path:
    """The recipes shipped inside the package (`hf_ccl/recipes/*.yaml`)."""
    return Path(str(resources.files("hf_ccl") / "recipes"))


def available_recipes() -> dict[str, Path]:
    """Shipped recipes by name (the file name without `.yaml`)."""
    return {path.stem: path for path in sorted(recipes_folder().glob(f"*{RECIPE_SUFFIX}"))}


def recipe_description(path: Path, limit: int = 110) -> str:
    """The first sentence of a recipe's leading comment (shortened to `limit` characters)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    end = text.find(". ")
    sentence = text[: end + 1] if end >= 0 else text
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def resolve_config(name_or_path: str | Path) -> Path:
    """A YAML file given by path, else a shipped recipe given by name (`digits` or `digits.yaml`)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    recipes = available_recipes()
    name = path.name[: -len(RECIPE_SUFFIX)] if path.name.endswith(RECIPE_SUFFIX) else path.name
    if path.parent == Path(".") and name in recipes:
        return recipes[name]
    if path.is_dir():
        raise ConfigError(f"Config {str(name_or_path)!r} is a folder, not a YAML file")
    raise ConfigError(f"Config {str(name_or_path)!r}: no such file, and no recipe of that name; recipes: "
                      f"{', '.join(recipes)} (see `hf-ccl list`)")


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML config file as a mapping (an error naming the file otherwise)."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = load_yaml(handle, str(path)) or {}
    except YAMLSizeError as error:
        raise ConfigError(str(error)) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"Cannot read {path}: {error}") from error
    if not isinstance(values, dict):
        raise ConfigError(f"{path} must be a mapping of config keys to values, got {type(values).__name__}")
    return values


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (a path, or the name of a shipped recipe), apply overrides, check every value. Unknown
    keys are errors listing the valid ones."""
    values: dict[str, Any] = {}
    source = None
    if path is not None:
        source = resolve_config(path)
        values = read_yaml(source)
    check_renamed_keys(values)  # a key of an earlier version: "hub_model_id is now hub.model_id"
    known_keys(values, config_fields(), "config key(s)", str(source or ""), listing="valid keys")
    for name in ("training", *SECTIONS):
        if name in values and values[name] is None:  # `training:` with nothing under it
            values[name] = {}
    values = apply_overrides(values, overrides or [])
    missing = [name for name in required_fields() if name not in values]
    if missing:
        raise ConfigError(f"Missing config key(s) {missing} ({where_given(None, source, overrides or [])})")
    try:
        return RunConfig(**values)
    except ConfigError as error:
        raise ConfigError(f"{error} ({where_given(error.key, source, overrides or [])})", error.key) from error


def where_given(key: str | None, source: Path | None, overrides: list[str]) -> str:
    """Where the value of a dotted `key` came from: "in the overrides", "in <file>", or both when unknown."""
    overridden = [".".join(parse_override(text)[0]) for text in overrides]
    if key is not None and any(key == o or key.startswith((o + ".", o + "[")) or o.startswith(key + ".")
                               for o in overridden):
        return "in the overrides"
    if key is not None or not overrides:
        return f"in {source}" if source else "in the defaults"
    return f"in {source} or the overrides" if source else "in the overrides"


def save_config(config: RunConfig, path: str | Path) -> None:
    write_text_atomic(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
