"""The `training` section of a continual run: which `transformers.TrainingArguments` fields it takes, and the check
of their values before anything is built, trained or written.

Every TrainingArguments field was read for what it does in a continual run (each task is one Trainer run, evaluated
by hf_ccl itself, seeded and checkpointed by the loop): those the loop sets itself or that would do nothing are
refused, with the reason and the hf_ccl option to use instead (`REFUSED`). The others are type-checked against
TrainingArguments' annotations, the common numbers range-checked, mixed precision checked against the machine, and
a trial `TrainingArguments` built (nothing is written) so that transformers' own checks also run up front.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch
import transformers
from transformers import TrainerCallback, TrainingArguments
from transformers.integrations import get_reporting_integration_callbacks

from .distributed import NotDistributedError, check_distributed_trainer, launch_defaults, launched_processes
from .training_defaults import NO_WARMUP_SCHEDULES, default_training, with_training_defaults  # noqa: F401 (re-exported)
from .validation import (
    ConfigError,
    check_choice,
    check_count_or_fraction,
    check_range,
    check_value,
    type_hints,
)

#: Why DeepSpeed cannot train an hf_ccl run, each holding on any device: measured with DeepSpeed 0.19.8 (torch 2.13,
#: accelerate 1.15, transformers 5.23) on 2 CPU processes, where ZeRO 1-3 do train a plain Trainer and SigLIP. Each fact
#: is re-checked by tests/scripts/deepspeed_limits.py, so tests/test_deepspeed.py fails when a release lifts one.
DEEPSPEED_LIMITS: dict[str, str] = {
    "scalar": "its engine refuses the 0-d logit_scale of CLIP, AltCLIP, Chinese-CLIP and MetaCLIP 2 when it "
    "broadcasts the parameters: \"self.dim() cannot be 0 to view Float as Byte (different element sizes)\"",
    "step": "accelerate's backward also steps the optimizer (DeepSpeed's engine.step), so the methods that edit or "
    "read gradients before the step (pre_optimizer_step: GEM, A-GEM, TEIR, DNS, SI, ...) act after it, and ZeRO-2 "
    "leaves no .grad to read (measured: A-GEM's weights drift from the DDP run's)",
    "zero3": "ZeRO-3 leaves each process an empty tensor for every parameter outside forward, so teachers, momentum "
    "models and anchors copied from the student are empty, and hf_ccl's evaluation and checkpoints on the main "
    "process alone wait forever in DeepSpeed's all-gather",
    "accumulation": "hf_ccl's exact accumulated step (gradient_accumulation_steps > 1) has no DeepSpeed path",
}
_EVALUATED = "hf_ccl evaluates every task itself after it has trained (the results matrix; its batch size is "\
    "evaluation.batch_size), so the Trainer never evaluates"
_TASK_SEEDS = "hf_ccl seeds task k with seed + k (model init, data order, caption sampling): set the top-level seed"

#: TrainingArguments fields a continual run refuses: {field: why, and what to use instead}.
REFUSED: dict[str, str] = {
    "output_dir": "each task's Trainer writes to <output_dir>/trainer/task-<k>: set the top-level output_dir",
    "remove_unused_columns": "hf_ccl sets it (the collator needs the image and text columns)",
    "eval_strategy": _EVALUATED,
    "do_eval": _EVALUATED,
    "do_train": "it is read by example scripts, not by the Trainer: every task trains",
    "do_predict": "it is read by example scripts, not by the Trainer; hf_ccl evaluates every task itself",
    "eval_steps": _EVALUATED,
    "eval_delay": _EVALUATED,
    "eval_on_start": _EVALUATED + " (evaluation.initial: true evaluates the model before the first task)",
    "per_device_eval_batch_size": _EVALUATED,
    "eval_accumulation_steps": _EVALUATED,
    "eval_do_concat_batches": _EVALUATED,
    "eval_use_gather_object": _EVALUATED,
    "prediction_loss_only": _EVALUATED,
    "include_for_metrics": _EVALUATED,
    "batch_eval_metrics": _EVALUATED,
    "fp16_full_eval": _EVALUATED + " in float32",
    "bf16_full_eval": _EVALUATED + " in float32",
    "load_best_model_at_end": _EVALUATED + "; every task's checkpoint is its trained model",
    "metric_for_best_model": _EVALUATED + "; every task's checkpoint is its trained model",
    "greater_is_better": _EVALUATED + "; every task's checkpoint is its trained model",
    "seed": _TASK_SEEDS,
    "data_seed": _TASK_SEEDS,
    "resume_from_checkpoint": "set the top-level resume_from_checkpoint (true, auto or a path): it resumes the "
    "stream from its last complete task, and the interrupted task from its last Trainer checkpoint",
    "disable_tqdm": "set the top-level progress: false",
    "hub_token": "a token in the config would be saved with the run: remove training.hub_token and set HF_TOKEN "
    "or run `hf auth login`",
    "hub_private_repo": "set hub.private (it applies to the task revisions and the Trainer's "
    "pushes alike)",
    "label_smoothing_factor": "hf_ccl's contrastive loss does not go through the Trainer's label smoother",
    "label_names": "hf_ccl's contrastive loss has no labels",
    "length_column_name": "grouping by length needs tokenized columns, which the stream's datasets do not have",
    "average_tokens_across_devices": "hf_ccl's losses are means over the global batch, not over token counts",
    "logging_nan_inf_filter": "hf_ccl sets it to false: a NaN or infinite loss stops the run with "
    "NonFiniteLossError (naming the first non-finite step), so the filter would only hide it, and its check makes "
    "the host wait for the GPU at every step",
    "use_cache": "a text-generation option: CLIP has no cache",
    "use_liger_kernel": "Liger has no kernels for CLIP",
    "liger_kernel_config": "Liger has no kernels for CLIP",
    "auto_find_batch_size": "the compute budget (samples_per_task) and the methods' state need the batch size "
    "you set: lower per_device_train_batch_size (with gradient_accumulation_steps) yourself",
    "local_rank": "the launcher sets it (accelerate launch, torchrun)",
    "deepspeed": "DeepSpeed 0.19.8's ZeRO 1-3 train a plain Trainer (measured on 2 CPU processes) but not an "
    "hf_ccl run: " + "; ".join(
        DEEPSPEED_LIMITS.values()) + ". Train with DDP (accelerate launch --multi_gpu) and, to fit a larger model, "
    "FSDP2 on GPUs (training.fsdp), training.bf16, training.gradient_checkpointing or the lora method",
    "parallelism_config": "context and tensor parallelism split each example's tokens or each layer across "
    "processes, which hf_ccl's step (it replaces Trainer.training_step, which prepares context-parallel inputs) and "
    "its contrastive loss over the global batch do not support: use DDP (accelerate launch --multi_gpu)",
}
#: Values refused for fields that are otherwise taken: {field: {value: why}}.
REFUSED_VALUES: dict[str, dict[Any, str]] = {
    "save_only_model": {True: "a mid-task checkpoint without optimizer, scheduler, RNG and method state cannot "
                        "resume its task; task checkpoints (model only) are written after every task anyway"},
    "save_strategy": {"best": "it needs evaluation during training; " + _EVALUATED},
    "optim": {
        optimizer: "LOMO optimizers update each parameter inside backward (the Trainer passes the learning rate to "
        "backward), so hf_ccl's exact accumulation and the methods' gradient edits before the optimizer step (GEM's "
        "projection, pre_optimizer_step) would never see a gradient: use another training.optim"
        for optimizer in ("lomo", "adalomo")
    },
    "train_sampling_strategy": {
        "group_by_length": "grouping by length needs tokenized columns, which the stream's datasets do not have",
        "batch_rebalance": "rebalancing by length needs tokenized columns, which the stream's datasets do not have",
    },
}
#: String values TrainingArguments takes for fields that also take a boolean (its annotation says only `str`).
STRING_CHOICES: dict[str, tuple[str, ...]] = {"include_num_input_tokens_seen": ("all", "non_padding", "no")}
#: Defaults the loop uses that differ from TrainingArguments' own (the rest of what it sets is refused above).
LOOP_DEFAULTS: dict[str, Any] = {"save_strategy": "no", "report_to": "none", "logging_steps": 10}


def _saves(training: Mapping[str, Any]) -> bool:
    return training.get("save_strategy", LOOP_DEFAULTS["save_strategy"]) != "no"


def _pushes(training: Mapping[str, Any]) -> bool:
    return bool(training.get("push_to_hub"))


_SAVE = "training.save_strategy: steps or epoch (hf_ccl's default is 'no': only the task checkpoints are written)"
_PUSH = "training.push_to_hub: true (the task revisions go to hub.model_id)"
#: Fields that do something only together with another setting: {field: (whether it has an effect, what to set)}.
#: Checked when the field is given a value other than null or false.
NEEDS: dict[str, tuple[Callable[[Mapping[str, Any]], bool], str]] = {
    "save_steps": (_saves, _SAVE),
    "save_total_limit": (_saves, _SAVE),
    "save_on_each_node": (_saves, _SAVE),
    "hub_model_id": (_pushes, _PUSH),
    "hub_revision": (_pushes, _PUSH),
    "hub_strategy": (_pushes, _PUSH),
    "hub_always_push": (_pushes, _PUSH),
    "gradient_checkpointing_kwargs": (lambda t: bool(t.get("gradient_checkpointing")),
                                      "training.gradient_checkpointing: true"),
    "activation_checkpointing_kwargs": (lambda t: bool(t.get("activation_checkpointing")),
                                        "training.activation_checkpointing: true"),
    "dataloader_persistent_workers": (lambda t: (t.get("dataloader_num_workers") or 0) > 0,
                                      "training.dataloader_num_workers >= 1"),
    "warmup_steps": (lambda t: t.get("lr_scheduler_type", "linear") not in NO_WARMUP_SCHEDULES,
                     "a schedule that warms up (constant_with_warmup, not constant): set one, or training.warmup_steps: 0"),
    "fsdp_config": (lambda t: t.get("fsdp") not in (None, False, "", []), "training.fsdp"),
}
#: Annotations of TrainingArguments that say less than the field takes (`fsdp: str | None`, and its help says
#: "fsdp=True").
ANNOTATION_FIXES: dict[str, Any] = {"fsdp": bool | str | list[str] | None}


@lru_cache(maxsize=1)
def training_fields() -> dict[str, Any]:
    """TrainingArguments' init fields and their annotations."""
    hints = {**type_hints(TrainingArguments), **ANNOTATION_FIXES}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


@lru_cache(maxsize=1)
def training_choices() -> dict[str, tuple[Any, ...]]:
    """The values TrainingArguments lists for a field (its `choices` metadata), and `STRING_CHOICES`."""
    listed = {f.name: tuple(f.metadata["choices"]) for f in dataclasses.fields(TrainingArguments)
              if f.init and "choices" in f.metadata}
    return {**listed, **STRING_CHOICES}


#: The transformers releases `hf_ccl.trainer.ContinualTrainer` was checked against: it replaces
#: `Trainer.training_step` and overrides private Trainer methods (`_save_checkpoint`, `_load_optimizer_and_scheduler`,
#: `_save_rng_state`, `_load_rng_state`, `_push_from_checkpoint`), whose behaviour a release may change without notice.
#: pyproject's dependency range is the same.
CHECKED_TRANSFORMERS = ("5.23", "5.24")  # [lowest, first unchecked)


def check_transformers_version(version: str | None = None) -> None:
    """Refuse (`ConfigError`) a transformers release outside `CHECKED_TRANSFORMERS`, naming the range to install."""
    from packaging.version import Version

    version = version or transformers.__version__
    low, high = CHECKED_TRANSFORMERS
    if not Version(low) <= Version(version) < Version(high):
        raise ConfigError(
            f"transformers {version} is installed; hf_ccl's ContinualTrainer overrides Trainer internals checked "
            f"against transformers >={low},<{high} only: install that range (pip install 'transformers>={low},<{high}')",
            "training")


def check_training_args(training: Mapping[str, Any]) -> dict[str, Any]:
    """The `training` section checked (only the keys given) and with lossless conversions applied; a
    `ConfigError` naming `training.<key>` at the first problem."""
    check_transformers_version()
    fields = training_fields()
    unknown = sorted(set(training) - set(fields))
    if unknown:
        raise ConfigError(
            f"Unknown training option(s) {unknown}; valid options are the fields of transformers.TrainingArguments, "
            "e.g. num_train_epochs, max_steps, per_device_train_batch_size, learning_rate, warmup_steps, weight_decay"
        )
    for key in training:
        if key in REFUSED:
            raise ConfigError(f"training.{key} is not taken: {REFUSED[key]}", f"training.{key}")
    training = {key: _yaml_no(key, value, fields[key]) for key, value in training.items()}
    checked = {key: check_value(f"training.{key}", value, fields[key]) for key, value in training.items()}
    for key, value in checked.items():
        if key in training_choices() and isinstance(value, str):
            check_choice(f"training.{key}", value, training_choices()[key])
        reasons = REFUSED_VALUES.get(key, {})
        if _hashable(value) and value in reasons:
            raise ConfigError(f"training.{key}={value!r} is not taken: {reasons[value]}", f"training.{key}")
    check_training_ranges(checked)
    if "ddp_backend" in checked and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise ConfigError("training.ddp_backend needs several processes (accelerate launch or torchrun); this is "
                          "one process: remove it", "training.ddp_backend")
    for key, (takes_effect, what) in NEEDS.items():
        if checked.get(key) not in (None, False, 0) and not takes_effect(checked):
            raise ConfigError(f"training.{key} has no effect without {what}", f"training.{key}")
    check_precision(checked)
    check_fsdp(checked)
    check_deepspeed_launch()
    _trial(checked)
    return checked


def _yaml_no(key: str, value: Any, annotation: Any) -> Any:
    """`False` for a field that takes "no" (its choices, or an enum with that value) is the YAML 1.1 reading of `no`
    (`training.save_strategy=no`): "no"."""
    if value is not False:
        return value
    choices = set(training_choices().get(key, ()))
    for option in (annotation, *typing.get_args(annotation)):
        if isinstance(option, type) and issubclass(option, enum.Enum):
            choices |= {member.value for member in option}
    return "no" if "no" in choices else value


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def check_training_ranges(training: Mapping[str, Any]) -> None:
    """Ranges of the common numeric fields (those given)."""

    def given(key: str, *args: Any, **kwargs: Any) -> None:
        if key in training:
            check_range(f"training.{key}", training[key], *args, **kwargs)

    given("num_train_epochs", 0, low_open=True)
    given("learning_rate", 0, low_open=True)
    given("weight_decay", 0)
    given("adam_beta1", 0, 1, high_open=True)
    given("adam_beta2", 0, 1, high_open=True)
    given("adam_epsilon", 0)
    given("max_grad_norm", 0, also="(0 turns clipping off)")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        given(key, 1)
    given("dataloader_num_workers", 0)
    given("dataloader_prefetch_factor", 1, also="or null")
    given("save_total_limit", 1, also="or null (keep every checkpoint)")
    given("torch_empty_cache_steps", 1, also="or null")
    given("neftune_noise_alpha", 0, low_open=True, also="or null")
    given("ddp_timeout", 0, low_open=True)
    max_steps = training.get("max_steps")
    if max_steps is not None and max_steps != -1 and max_steps < 1:
        raise ConfigError(f"training.max_steps must be -1 (train for num_train_epochs) or >= 1, got {max_steps!r}",
                          "training.max_steps")
    for key in ("warmup_steps", "logging_steps", "save_steps"):
        if key in training:
            check_count_or_fraction(f"training.{key}", training[key])
    for key in ("logging_steps", "save_steps"):
        given(key, 0, low_open=True)


def accelerator() -> str | None:
    """The accelerator torch would train on (`cuda`, `mps`, `xpu`, ...), or None on a CPU-only machine."""
    device = torch.accelerator.current_accelerator(check_available=True)
    return device.type if device is not None else None


def check_precision(training: Mapping[str, Any]) -> None:
    """fp16 / bf16 refused where this machine cannot run them (accelerate would drop fp16 on a CPU silently)."""
    fp16, bf16, use_cpu = training.get("fp16"), training.get("bf16"), training.get("use_cpu")
    device = None if use_cpu else accelerator()
    if fp16 and bf16:
        raise ConfigError("training.fp16 and training.bf16 are both true: choose one")
    if fp16 and device is None:
        where = "training.use_cpu is true" if use_cpu else "this machine has no GPU (torch.cuda.is_available() is False)"
        raise ConfigError(f"training.fp16 needs a GPU, but {where}: remove it, or on a CPU use training.bf16: true "
                          "with training.use_cpu: true")
    if bf16 and device is None and not use_cpu:
        raise ConfigError("training.bf16 on a machine without a GPU needs training.use_cpu: true (bf16 autocast on "
                          "the CPU); set it, or remove training.bf16")
    if bf16 and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"training.bf16: this GPU ({torch.cuda.get_device_name()}) has no bf16 support: use "
                          "training.fp16 instead")


#: FSDP versions hf_ccl does not train with, and why (torch 2.13, accelerate 1.15, transformers 5.23).
FSDP_REFUSED_VERSIONS: dict[str, str] = {
    "1": "transformers deprecates FSDP1, accelerate cannot build its plugin without a GPU (sync_module_states), and "
    "under FSDP1 the methods would see flattened parameter shards; use FSDP2 (training.fsdp_config.version: 2, or "
    "accelerate launch --use_fsdp --fsdp_version 2)",
}
#: Why FSDP2 cannot run on a machine without a GPU (re-checked by tests/scripts/fsdp_limits.py).
FSDP_CPU_LIMIT = ("accelerate keeps its FSDP plugin only on GPU-like devices: on the CPU (gloo) it drops it without a "
                  "word and the run would train as plain DDP, every process holding the whole model")

#: Why the Trainer's own (mid-task) checkpoints cannot be written from an FSDP2 model on this stack.
FSDP_MID_TASK_LIMIT = ("accelerate 1.15 forgets DistributedType.FSDP as soon as another AcceleratorState() is built "
                       "(its AcceleratedOptimizer builds one; AcceleratorState.__init__ copies PartialState's "
                       "distributed type over it), so Trainer.save_model writes the sharded DTensors and fails")


def accelerate_keeps_fsdp(training: Mapping[str, Any]) -> bool:
    """Whether accelerate would keep an FSDP plugin for this run: only on an accelerator (its `AcceleratorState`
    sets `DistributedType.FSDP` for MULTI_GPU, MULTI_XPU, ..., never MULTI_CPU)."""
    return accelerator() is not None and not training.get("use_cpu")


def fsdp_request(training: Mapping[str, Any]) -> tuple[str, str] | None:
    """(where FSDP was asked for, its version) when the `training` section or the launcher asks for it, else None.

    The launcher asks through `ACCELERATE_USE_FSDP` (`accelerate launch --use_fsdp`, or an accelerate config file
    with `distributed_type: FSDP`) and `FSDP_VERSION`."""
    if training.get("fsdp") not in (None, False, "", []):
        config = training.get("fsdp_config")
        version = config.get("version", config.get("fsdp_version", 2)) if isinstance(config, Mapping) else 2
        return "training.fsdp", str(version)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return "accelerate launch with FSDP (ACCELERATE_USE_FSDP)", os.environ.get("FSDP_VERSION", "1")
    return None


def check_deepspeed_launch() -> None:
    """DeepSpeed asked for by the launcher (`accelerate launch --use_deepspeed`, or an accelerate config with
    `distributed_type: DEEPSPEED`, which sets `ACCELERATE_USE_DEEPSPEED`) is refused as `training.deepspeed` is."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true"):
        raise ConfigError(f"accelerate launch with DeepSpeed (ACCELERATE_USE_DEEPSPEED) is not taken: "
                          f"{REFUSED['deepspeed']}", "training.deepspeed")


def check_fsdp(training: Mapping[str, Any]) -> None:
    """FSDP checked before anything is built: FSDP2 on several processes of a GPU machine, one optimizer step per
    micro-batch; FSDP1, one process, a CPU machine and gradient accumulation are refused, each with its reason. The
    methods that cannot train sharded are refused by `hf_ccl.checks.check_fsdp_methods`."""
    request = fsdp_request(training)
    if request is None:
        return
    where, version = request
    if version != "2":
        reason = FSDP_REFUSED_VERSIONS.get(version, f"FSDP version {version!r} does not exist (accelerate has 1 and 2)")
        raise ConfigError(f"{where}: FSDP{version} is not taken: {reason}", "training.fsdp")
    if launched_processes() <= 1:
        raise ConfigError(f"{where}: FSDP shards the model across processes, and this is one process: launch several "
                          "(accelerate launch --num_processes N, torchrun), or remove it", "training.fsdp")
    if not accelerate_keeps_fsdp(training):
        raise ConfigError(f"{where}: FSDP2 needs a GPU: {FSDP_CPU_LIMIT}. On this machine train with DDP "
                          "(accelerate launch --multi_gpu)", "training.fsdp")
    if _saves(training):
        raise ConfigError(f"{where}: the Trainer's mid-task checkpoints (training.save_strategy) are not taken with "
                          f"FSDP: {FSDP_MID_TASK_LIMIT}. The task checkpoints (task-<k>/) are written from the gathered "
                          "model and resume exactly: remove training.save_strategy", "training.save_strategy")
    if (training.get("gradient_accumulation_steps") or 1) > 1:
        raise ConfigError(f"{where}: training.gradient_accumulation_steps > 1 is not taken with FSDP: hf_ccl's exact "
                          "contrastive accumulation runs on one process and DDP only; use a larger "
                          "per_device_train_batch_size", "training.gradient_accumulation_steps")


def _trial(training: Mapping[str, Any]) -> None:
    """Build the TrainingArguments a task would get (nothing is written) so that transformers' own checks run now, and
    the check that launched processes train as one DDP run (`hf_ccl.distributed.check_distributed_trainer`)."""
    values = {**LOOP_DEFAULTS, **launch_defaults(training), **training, "remove_unused_columns": False,
              "eval_strategy": "no"}
    try:
        check_distributed_trainer(TrainingArguments(output_dir="unused", **values))  # several processes: one DDP run
    except NotDistributedError as error:
        raise ConfigError(str(error), "training.use_cpu" if "use_cpu" in training else "training") from error
    except (ValueError, ImportError, OSError) as error:
        raise ConfigError(f"training: {error}") from error


def integration_names(report_to: str | Sequence[str] | None) -> list[str]:
    """`training.report_to` resolved as TrainingArguments resolves it ("all", "none", one name or a list)."""
    if report_to is not None and not isinstance(report_to, str):
        report_to = list(report_to)
    resolved = TrainingArguments(output_dir="unused", report_to="none" if report_to is None else report_to).report_to
    return [resolved] if isinstance(resolved, str) else list(resolved or ())


def reporting_callbacks(report_to: str | Sequence[str] | None) -> list[TrainerCallback]:
    """One new callback per integration `training.report_to` names; an unknown name or an integration whose package
    is missing is an error naming the option."""
    names = integration_names(report_to)
    try:
        classes = get_reporting_integration_callbacks(names)
    except ValueError as error:
        raise ValueError(f"training.report_to: {error}") from error
    callbacks = []
    for name, callback_class in zip(names, classes, strict=True):
        try:
            callbacks.append(callback_class())
        except (ImportError, RuntimeError) as error:
            raise RuntimeError(f"training.report_to names {name!r}, which cannot be used here: {error}") from error
    return callbacks
