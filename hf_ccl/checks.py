"""The checks of a run that need more than its arguments: the methods, the model's family, the stream and the image
processor against the arguments and each other. One place, run once per run.

Each arguments dataclass checks its own values (`hf_ccl.arguments`); what crosses concerns is checked here, in two
steps by what it needs:
- `check_plan(args, methods, family)`: methods x arguments x family, before anything is built (`hf-ccl train`
  calls it from `hf_ccl.run.check_config`, so a refusal exits 2 before any data is read or file written);
- `check_stream_plan(stream, methods, args, image_processor)`: what needs the built stream.
`check_run` is what `ContinualLearner` calls: both steps, the first skipped when the `RunPlan` it is given already
covers these arguments and methods (the CLI's), so nothing is checked twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .arguments import ContinualArguments
from .data.image_cache import check_image_cache
from .data.streaming import column_names, is_empty, is_streaming
from .data.task import ModelPart, TaskStream
from .families import check_family_methods
from .methods.base import ContinualMethod
from .methods.registry import METHODS, check_methods
from .training_options import fsdp_request
from .validation import ConfigError


@dataclass(frozen=True)
class RunPlan:
    """What `check_plan` checked: these arguments and methods (by identity), against `family` (None: the family
    was not known before the model was built, e.g. a Hub id without `model.family`)."""

    args: ContinualArguments
    methods: tuple[ContinualMethod, ...]
    family: str | None

    def covers(self, args: ContinualArguments, methods: Sequence[ContinualMethod]) -> bool:
        """Whether these very arguments and methods were checked."""
        return self.args is args and len(self.methods) == len(methods) and all(
            mine is theirs for mine, theirs in zip(self.methods, methods, strict=True))


def check_plan(args: ContinualArguments, methods: Sequence[ContinualMethod], family: Any = None) -> RunPlan:
    """Methods x arguments x family, before anything is built: the methods' combination and compute budget, the
    family's unsupported methods (`family`: a name, a model or its class; None: not known yet), a classification
    loss that a method replaces."""
    methods = list(methods)
    check_methods(methods, args.samples_per_task)
    if family is not None:
        check_family(family, methods)
    check_fsdp_methods(args, methods)
    replacing = [method.name for method in methods if method.replaces_contrastive_loss]
    if args.classification_loss == "cross_entropy" and replacing:
        raise ConfigError(f"classification_loss: cross_entropy replaces the contrastive loss, and so does "
                          f"{replacing[0]} (its terms are the whole loss): use one of them", "classification_loss")
    return RunPlan(args, tuple(methods), family_name(family))


def check_fsdp_methods(args: ContinualArguments, methods: Sequence[ContinualMethod]) -> None:
    """Under FSDP2, the methods that cannot train a sharded student (`ContinualMethod.fsdp_refusal`), refused."""
    request = fsdp_request(args.training)
    if request is None:
        return
    for method in methods:
        if method.fsdp_refusal is not None:
            raise ConfigError(f"{request[0]}: method {method.name!r} cannot train under FSDP2: {method.fsdp_refusal}. "
                              "Train it with DDP (accelerate launch --multi_gpu)", "methods")


def check_family(family: Any, methods: Sequence[ContinualMethod]) -> None:
    """The methods the family (a name, a model or its class) cannot train, refused with the family's reasons."""
    try:
        check_family_methods(family, methods)
    except ValueError as error:
        raise ConfigError(str(error), "methods") from None


def family_name(family: Any) -> str | None:
    """The family's name from a name, a model or its class (None stays None)."""
    return family if family is None or isinstance(family, str) else str(family.family)


def check_stream_plan(
    stream: TaskStream, methods: Sequence[ContinualMethod], args: ContinualArguments, image_processor: Any
) -> None:
    """What needs the built stream: its tasks and splits, streaming tasks' budget, options that apply to task kinds
    it has not, pair tasks' methods, the image cache, each method's own `check_stream`, the diagnostics task."""
    validate_stream(stream, args)
    check_pair_stream(stream, list(methods), args)
    check_image_cache(stream, image_processor, args.image_cache)
    for method in methods:
        method.check_stream(stream)
    task = args.diagnostics.spatial_disorder_task
    if task is not None and not 0 <= task < len(stream):
        raise ConfigError(f"diagnostics.spatial_disorder_task must index a task of the stream (0..{len(stream) - 1})",
                          "diagnostics.spatial_disorder_task")


def check_run(
    model: Any,
    stream: TaskStream,
    methods: Sequence[ContinualMethod],
    args: ContinualArguments,
    image_processor: Any,
    plan: RunPlan | None = None,
) -> RunPlan:
    """Every check of a run that crosses concerns, once: `check_plan` (unless `plan` covers these arguments and
    methods; the family is checked on `model` when the plan could not), then `check_stream_plan`."""
    if plan is None or not plan.covers(args, methods):
        plan = check_plan(args, methods, model)
    elif plan.family is None:
        check_family(model, methods)
        plan = RunPlan(plan.args, plan.methods, family_name(model))
    check_stream_plan(stream, methods, args, image_processor)
    return plan


def validate_stream(stream: TaskStream, args: ContinualArguments | None = None) -> None:
    """Empty streams, empty tasks and non-canonical datasets fail here, before any training. A streaming train split
    (`datasets.IterableDataset`) is checked by its features or first row, never read whole; with `args`, a stream
    of such tasks needs a compute budget (a stream has no length, so no epochs)."""
    if len(stream) == 0:
        raise ValueError(f"Stream {stream.name!r} has no tasks")
    for index, task in enumerate(stream):
        for split_name, dataset in (("train", task.train), ("eval", task.eval)):
            where = f"Stream {stream.name!r}, task {index} ({task.name!r})"
            columns = column_names(dataset)  # a stream without known features: its first row's (none when empty)
            missing = [c for c in task.required_columns if c not in columns]
            if missing and (columns or not is_streaming(dataset)):
                raise ValueError(
                    f"{where}, {split_name} split: missing column(s) {missing}; it has {columns}. Build tasks with "
                    "hf_ccl.data builders."
                )
            if is_empty(dataset):
                raise ValueError(f"{where}: the {split_name} split is empty")
        if args is not None and is_streaming(task.train):
            _check_streaming_budget(args.training, args.samples_per_task, args.first_task_epochs, index, task.name)
    if args is not None and not any(kind.has_classes for kind in stream.kinds):
        for key, value, default in (("classification_loss", args.classification_loss, "contrastive"),
                                    ("class_scope", args.class_scope, "task")):
            if value != default:
                raise ConfigError(f"{key}: {value} applies to classification tasks, and stream {stream.name!r} has "
                                  f"none: remove it", key)


def _check_streaming_budget(
    training: dict[str, Any], samples_per_task: int | None, first_task_epochs: float | None, index: int, name: str
) -> None:
    """A streaming task trains for a fixed number of steps: `samples_per_task` or `training.max_steps` (and not the
    first task's epochs)."""
    if samples_per_task is not None:
        return
    if int(training.get("max_steps", -1)) > 0 and not (index == 0 and first_task_epochs is not None):
        return
    raise ValueError(
        f"Task {index} ({name!r}) trains on a stream (an IterableDataset has no length, so no epochs): streaming "
        "tasks need samples_per_task or training.max_steps (and no first_task_epochs)"
    )


def check_pair_stream(stream: TaskStream, methods: list[ContinualMethod], args: ContinualArguments) -> None:
    """Tasks whose kind trains learner heads on cached features (CMCL's pair tasks, `ModelPart.LEARNER_HEADS`) need
    the method that attaches them (`learner_heads`) and one micro-batch per step (the exact accumulation of
    `hf_ccl.accumulation` is CLIP's loss)."""
    if not any(kind.trains is ModelPart.LEARNER_HEADS for kind in stream.kinds):
        return
    if not any(method.attaches is ModelPart.LEARNER_HEADS for method in methods):
        raise ConfigError(f"stream {stream.name!r} has pair tasks: they train learner heads on the frozen CLIP's "
                          "features; add the learner_heads method (first in methods)", "methods")
    unsupported = [method.name for method in methods if not method.trains_pair_tasks]
    if unsupported:
        supported = sorted(name for name, cls in METHODS.items() if cls.trains_pair_tasks)
        raise ConfigError(f"method(s) {unsupported} do not train pair tasks (CMCL's learner heads on cached features); "
                          f"methods for pair streams: {supported}", "methods")
    if args.diagnostics.spatial_disorder_task is not None:
        raise ConfigError("diagnostics.spatial_disorder_task measures image-text embeddings of a CLIP task; a pair "
                          "stream has none: remove it", "diagnostics.spatial_disorder_task")
    if int(args.training.get("gradient_accumulation_steps", 1)) > 1:
        raise ConfigError("pair tasks train with one micro-batch per optimizer step: remove "
                          "training.gradient_accumulation_steps", "training.gradient_accumulation_steps")
