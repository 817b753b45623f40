"""Run configuration: one YAML file (read with a safe loader) plus command-line overrides `key.sub=value`."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .modeling import tiny_clip_config


def _default_training() -> dict[str, Any]:
    return {
        "num_train_epochs": 8,
        "per_device_train_batch_size": 64,
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
        "warmup_steps": 0.1,
        "lr_scheduler_type": "cosine",
        "logging_steps": 10,
    }


@dataclass
class RunConfig:
    """Everything a continual run needs. Every field can be overridden on the command line (`training.seed=3`)."""

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
        metadata={"help": "pretrained: checkpoint path or Hub id; else config: tiny_clip_config() options."},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer name or path; default the checkpoint's, else the real CLIP BPE."}
    )
    output_dir: str = field(default="outputs/run", metadata={"help": "Run folder (task checkpoints, results)."})
    seed: int = field(default=0, metadata={"help": "Seed of model init, data order and sampling."})
    training: dict[str, Any] = field(
        default_factory=_default_training, metadata={"help": "transformers.TrainingArguments fields, for every task."}
    )
    first_task_epochs: float | None = field(default=None, metadata={"help": "Epochs of the first task."})
    eval_batch_size: int = field(default=256, metadata={"help": "Batch size of evaluation."})
    max_length: int | None = field(default=None, metadata={"help": "Token limit; default the model's context."})
    progress: bool = field(default=True, metadata={"help": "Progress bars."})
    spatial_disorder_task: int | None = field(
        default=None, metadata={"help": "Mod-X spatial-disorder diagnostics on this task's eval split; None: off."}
    )

    samples_per_task: int | None = field(
        default=None, metadata={"help": "Compute budget: training samples per task (sets max_steps); None: epochs."}
    )
    evaluate_initial: bool = field(default=True, metadata={"help": "Evaluate the model before the first task."})
    warmup: str = field(default="every_task", metadata={"help": "'every_task' or 'first_task' (TiC-CLIP)."})
    resume_from_checkpoint: bool | str | None = field(
        default=None,
        metadata={"help": "true: continue from the last complete task (local, else Hub); 'auto': same, or start "
                  "afresh; a path: that checkpoint."},
    )
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Push every task to this Hub repo (main + branch task-<k>); token from HF_TOKEN."}
    )
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the Hub repo as private."})
    hub_timeout: float = field(default=60.0, metadata={"help": "Seconds before a Hub request is abandoned."})
    hub_retries: int = field(default=3, metadata={"help": "Retries with backoff of a failing Hub request."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the shape of every section; deeper checks happen when each part is built, before training."""
        if isinstance(self.methods, str):
            self.methods = [self.methods]
        model_keys = {"pretrained", "config"}
        unknown = sorted(set(self.model) - model_keys)
        if unknown:
            raise ValueError(f"Unknown model option(s) {unknown}; valid: {sorted(model_keys)}")
        config_keys = set(inspect.signature(tiny_clip_config).parameters)
        unknown = sorted(set(self.model.get("config") or {}) - config_keys)
        if unknown:
            raise ValueError(f"Unknown model.config option(s) {unknown}; valid: {sorted(config_keys)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def parse_override(text: str) -> tuple[list[str], Any]:
    """`training.learning_rate=1e-3` -> (["training", "learning_rate"], 0.001); values are YAML."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ValueError(f"Override {text!r} is not of the form key=value (e.g. training.num_train_epochs=2)")
    parsed = yaml.safe_load(value) if value.strip() else None
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
        if path[0] not in valid:
            raise ValueError(f"Unknown config key {path[0]!r} in override {text!r}; valid keys: {', '.join(valid)}")
        target = values
        for part in path[:-1]:
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise ValueError(f"Override {text!r}: {part!r} is not a section")
            target = target[part]
        target[path[-1]] = value
    return values


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (unknown keys are an error listing the valid ones) and apply overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        if not isinstance(values, dict):
            raise ValueError(f"Config {path} must be a mapping of keys to values")
    unknown = sorted(set(values) - set(config_fields()))
    if unknown:
        raise ValueError(f"Unknown config key(s) {unknown} in {path}; valid keys: {', '.join(config_fields())}")
    if "training" in values:  # a config's training section extends the defaults
        values["training"] = {**_default_training(), **(values["training"] or {})}
    values = apply_overrides(values, overrides or [])
    return RunConfig(**values)


def save_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")
