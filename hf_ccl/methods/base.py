"""The method plugin interface: what a continual-learning method may change, and where (DESIGN.md, "The one idea").

| hook                   | what it is for                                                         |
|------------------------|------------------------------------------------------------------------|
| `on_task_start`        | change the model before a task (vocabulary growth, adapters, heads)    |
| `train_dataset`        | transform the data a task trains on (replay, joint training)           |
| `training_overrides`   | change this task's TrainingArguments (Oracle's larger budget, warmup)  |
| `collator_options`     | extra `CLIPCollator` options for this task (e.g. parallel captions)    |
| `reference_data`       | images and texts from outside the stream, batched every step (ZSCL)    |
| `loss_terms`           | extra named loss terms, added to the contrastive loss and logged       |
| `replaces_contrastive_loss` | (class flag) the loss is the methods' terms alone (CLL-CLIP)      |
| `no_weight_decay`      | model parameters the optimizer must not decay (TEIR decays per row)    |
| `optimizer_parameters` | method-owned tensors the task's optimizer also trains (a temperature)  |
| `pre_optimizer_step`   | edit gradients between backward and the optimizer step (projection)    |
| `post_optimizer_step`  | edit parameters right after the optimizer step (update projection)     |
| `after_training`       | change the trained model before it is evaluated (weight patching)     |
| `on_task_end`          | update method state after a task (teachers, Fisher, buffers)           |
| `metrics`              | diagnostics logged beside the loss terms (not added to the loss)       |
| `state_dict` / `load_state_dict` | what must survive a restart, saved beside each task checkpoint |
| `check_model`          | refuse options the model cannot take (sizes), before the model is built |
| `checkpoint_loader`    | (class attribute) the loader of the evaluated model, when the weights alone are another |

Methods compose: a run holds a list of them and calls each hook of each, in order. Each method declares what rules
out a combination or an order (`roles`, `conflicts`, `runs_after`, `runs_before`; checked by `build_methods`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast, get_args, get_origin

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase, TrainingArguments

from ..data.task import ModelPart
from ..validation import ConfigError, check_mapping, type_hints
from .loading import CheckpointLoader

if TYPE_CHECKING:
    from ..data.reference import ReferenceData
    from ..data.task import Task, TaskStream
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput


@dataclass
class MethodConfig:
    """Hyperparameters of a method; subclasses add fields, each with `metadata={"help": ...}`."""

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, method_name: str = "") -> MethodConfig:
        """Build from a plain dict: unknown keys are rejected with the list of valid ones, each value is checked
        against the field's annotation (`hf_ccl.validation`), then the config's own range checks run. Every error
        names `method_args.<method>.<option>`."""
        name = method_name or cls.__name__
        values = dict(values or {})
        valid = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - valid)
        if unknown:
            keys = [f"method_args.{name}.{option}" for option in unknown]
            raise ConfigError(f"Unknown option(s) {', '.join(keys)} for method {name}; valid options: "
                              f"{sorted(valid) or 'none'}", keys[0] if len(keys) == 1 else f"method_args.{name}")
        checked = check_mapping(values, type_hints(cls), f"method_args.{name}.")
        try:
            return cls(**checked)
        except ValueError as error:  # the config's own range and choice checks
            message = str(error).removeprefix(f"{name}: ")
            option = getattr(error, "key", None)  # a `ConfigError` (a ValueError) names its option
            key = f"method_args.{name}" + (f".{option}" if option else "")
            raise ConfigError(f"method_args.{name}: {message}", key) from error

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TaskContext:
    """What a hook knows about the run: the task, its place in the stream, the model being trained, and what the loop
    trains and evaluates it with.

    A hook changes the model or the tokenizer in one way: by assigning `context.model` (an adapter-wrapped model,
    a patched one) or calling `context.replace_tokenizer` (a vocabulary grown for a new language); the loop then
    trains, evaluates and saves with what the context holds. The fields under "set when the task trains" are filled
    by the loop and the trainer as the task goes (None before).
    """

    task_index: int
    task: Task
    stream: TaskStream
    model: ContinualDualEncoder
    output_dir: Path | None = None
    seed: int = 0
    global_step: int = 0
    #: The run's tokenizer and image processor (the tokenizer after any growth at this task's start).
    tokenizer: PreTrainedTokenizerBase | None = None
    image_processor: Any = None
    #: Token ids the tokenizer gained at this task's start (`grow_vocab`).
    new_token_ids: list[int] = field(default_factory=list)
    #: Token limit of the collators and the evaluation.
    max_length: int | None = None
    eval_batch_size: int = 256
    #: The run's compute budget (training examples per task), None without one.
    samples_per_task: int | None = None
    #: The run's `training` options as configured (before the budget and warmup rules).
    base_training: dict[str, Any] = field(default_factory=dict)
    #: What a resume must match; stored in mid-task checkpoints.
    run_settings: dict[str, Any] | None = None
    #: The task checkpoint the run resumed from or last wrote (None before the first).
    last_checkpoint: str | None = None
    #: With `classification_loss: cross_entropy` on a classification task: the class prompts its loss scores rows
    #: among (`hf_ccl.class_prompts.ClassPrompts`); None when the task trains with the contrastive loss.
    class_prompts: Any = None
    #: Each method's reference batches (`hf_ccl.data.reference.ReferenceBatches`), by method name: built by the
    #: loop from the method's `reference_data`; read with `reference_batch`.
    references: dict[str, Any] = field(default_factory=dict)
    # --- set when the task trains -------------------------------------------------------------------------------
    #: This task's `TrainingArguments` and its torch optimizer (before Accelerate wraps it).
    training_args: TrainingArguments | None = None
    optimizer: torch.optim.Optimizer | None = None
    #: What the task trained on (after the methods' `train_dataset` transforms) and an eval-mode `CLIPCollator` for it.
    train_dataset: Any = None
    collator: Any = None
    per_device_batch_size: int | None = None
    #: The Trainer's `state.log_history` of this task, after it trained.
    log_history: list[dict[str, Any]] = field(default_factory=list)
    #: Wall seconds of the task by phase so far (`hf_ccl.compute.PHASES`), timed by the loop.
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def seen_tasks(self) -> list[Task]:
        """Tasks trained so far, this one included."""
        return self.stream.tasks[: self.task_index + 1]

    def reference_batch(self, method: ContinualMethod, device: torch.device | str | None = None
                        ) -> dict[str, torch.Tensor]:
        """`method`'s reference batch of the optimizer step in progress (`global_step`, set by the trainer before
        the loss), collated like the task's batches: image inputs, `input_ids`, `attention_mask`."""
        if method.name not in self.references:
            raise ValueError(f"method {method.name!r} has no reference data: return it from its reference_data hook")
        return self.references[method.name].batch(self.global_step, device)

    def replace_tokenizer(self, tokenizer: PreTrainedTokenizerBase, new_token_ids: list[int] | None = None) -> None:
        """Train, evaluate and save from now on with `tokenizer` (its `new_token_ids` added at this task)."""
        self.tokenizer = tokenizer
        self.new_token_ids = list(new_token_ids or [])

    @property
    def extras(self) -> dict[str, Any]:
        """Removed: the context's fields are typed attributes now (`context.tokenizer`, `context.collator`, ...)."""
        raise AttributeError("TaskContext.extras was replaced by typed attributes: use context.tokenizer, "
                             "context.collator, context.train_dataset, context.optimizer, context.training_args, ...")


#: A method's config class: `class ZSCL(ContinualMethod[ZSCLConfig])` types `self.config` as a `ZSCLConfig`.
ConfigT = TypeVar("ConfigT", bound=MethodConfig)


def pair_modalities(task: Task) -> tuple[str, str]:
    """The modality pair of a pair task (ValueError for a task of another kind, which has none)."""
    if task.modalities is None:
        raise ValueError(f"task {task.name!r} has no modality pair: it is not a pair task")
    return task.modalities


#: `ContinualMethod.fsdp_refusal` of a method not checked under FSDP2.
FSDP_NOT_CHECKED = ("its training under FSDP2 was not checked against the unsharded run (its hooks may read the "
                    "student's parameters or gradients, which FSDP2 holds as shards during training)")


class ContinualMethod(Generic[ConfigT]):
    """Base class of every method: all hooks are no-ops, so a method overrides only what it changes.

    Generic in its config: a method with options subclasses `ContinualMethod[ItsConfig]` and sets
    `config_class = ItsConfig` (checked to agree when the class is defined); `self.config` is then typed."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    config: ConfigT
    #: True when the method's loss terms are the whole loss: `ContinualTrainer` then leaves out the model's own
    #: contrastive loss (CLL-CLIP trains with its cross-lingual and cross-modal terms only).
    replaces_contrastive_loss: ClassVar[bool] = False
    #: True when the method needs a compute budget (`samples_per_task`), e.g. Oracle's t x C steps at step t.
    needs_compute_budget: ClassVar[bool] = False
    #: True when the method is correct on pair tasks (CMCL's learner heads on cached features, `learner_heads`):
    #: its hooks handle feature batches of one modality pair per task. Others are refused on pair streams.
    trains_pair_tasks: ClassVar[bool] = False
    #: The part of the model the method adds for the tasks whose kind trains it (`TaskKind.trains`): the
    #: `learner_heads` method attaches `ModelPart.LEARNER_HEADS`, which a pair stream needs. None: it adds none.
    attaches: ClassVar[ModelPart | None] = None
    #: True when the method trains a task on rows of earlier tasks too (replay, joint training): a cross-entropy loss
    #: (`classification_loss: cross_entropy`) then also encodes the earlier tasks' class prompts, each row scored
    #: among its own task's classes (`hf_ccl.class_prompts`).
    trains_on_past_tasks: ClassVar[bool] = False
    #: False when the method never trains the model (RAIL fits a closed-form regression on its frozen features after
    #: each task): its `training_overrides` make the Trainer take no step, and no other method may join it (theirs
    #: would train the model it keeps frozen; `check_combination`).
    trains_model: ClassVar[bool] = True

    # Combinations, declared by each method and checked by `build_methods` before anything is built or trained.
    #: What the method does that another method may clash with: {role: what it does} (the text is used in errors).
    #: Roles in use: "training_data" (chooses the data a task trains on), "previous_model" (builds on the model the
    #: previous task left), "fresh_model" (replaces it), "similarity_distillation", "parameter_efficient" (freezes
    #: the model but for its own parameters), "vocabulary" (grows the tokenizer).
    roles: ClassVar[dict[str, str]] = {}
    #: Roles no other method of the run may have: {role: why}. A method that lists one of its own roles here is
    #: the only one of the run with that role (two methods that both choose the training data).
    conflicts: ClassVar[dict[str, str]] = {}
    #: Roles whose methods must come earlier in the method list: {role: why}.
    runs_after: ClassVar[dict[str, str]] = {}
    #: Roles whose methods must come later in the method list: {role: why}.
    runs_before: ClassVar[dict[str, str]] = {}
    #: How to load the model this method's runs evaluated when a checkpoint's weights alone, loaded with plain
    #: transformers, are another model (part of it is kept in the method state); None when they are the evaluated
    #: model. The model card's "How to use" gives it (`hf_ccl.methods.loading`).
    checkpoint_loader: ClassVar[CheckpointLoader | None] = None

    # How the every-method test matrix (`tests/method_matrix.py`) runs the method. Read from the class's own body,
    # not inherited (a subclass is another method); the defaults fit a new method: trained on CLIP with its default
    # options on the `digits` stream, in every default check, as the representative of a step of its own.
    #: Options that let it train in seconds on the tests' 64-example tasks of a tiny model (a smaller buffer).
    test_options: ClassVar[dict[str, Any]] = {}
    #: The bundled stream the matrix trains it on (methods that attach learner heads run on a pair stream).
    test_stream: ClassVar[str] = "digits"
    #: The method whose training step this one's is (same losses, hooks and per-step state; it differs in data,
    #: aliases, formulas or task-end work): the expensive checks run that one by default and this one under `-m slow`.
    same_step_as: ClassVar[str | None] = None
    #: The method whose class this one is under another formula or alias (TiC-CLIP's names for the same loop): every
    #: matrix run of this one is under `-m slow`.
    variant_of: ClassVar[str | None] = None
    #: The families besides CLIP whose default matrix runs this method (the others run it under `-m slow`).
    test_families: ClassVar[tuple[str, ...]] = ()
    #: Why this method cannot train a student sharded by FSDP2 (`hf_ccl.sharding`), refused before anything is built;
    #: None where it trains sharded exactly as unsharded (tests/test_fsdp.py checks every method that says so).
    #: Inherited: a variant trains sharded as its parent does unless it says otherwise.
    fsdp_refusal: ClassVar[str | None] = FSDP_NOT_CHECKED

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        if config is None or isinstance(config, dict):
            config = self.config_class.from_dict(config, self.name)
        if not isinstance(config, self.config_class):
            raise TypeError(f"Method {self.name!r} expects a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = cast(ConfigT, config)  # an instance of `config_class`, which __init_subclass__ ties to ConfigT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """`config_class` from the config the class is generic in (`ContinualMethod[ItsConfig]`) when the body sets
        none; a `config_class` that is not that config is refused."""
        super().__init_subclass__(**kwargs)
        for base in vars(cls).get("__orig_bases__", ()):
            declared, origin = get_args(base), get_origin(base)
            if not (declared and isinstance(origin, type) and issubclass(origin, ContinualMethod)
                    and isinstance(declared[0], type)):
                continue
            if "config_class" not in vars(cls):
                cls.config_class = declared[0]
            elif not issubclass(cls.config_class, declared[0]):
                raise TypeError(f"{cls.__name__} is {origin.__name__}[{declared[0].__name__}] but its config_class "
                                f"is {cls.config_class.__name__}")

    def check_stream(self, stream: TaskStream) -> None:
        """Refuse a stream the method cannot train (raise ValueError), before anything is built or trained."""

    def check_task_steps(self, task_index: int, task_name: str, steps: int) -> None:
        """Refuse (raise ValueError naming the option) a task of `steps` optimizer steps that the method cannot
        train as asked; called for every task before the stream trains (where the steps are known then) and again
        before each task trains, with its exact count."""

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse options the model cannot take (raise `ConfigError` naming `method_args.<method>.<option>`), from
        its structure and sizes alone: `model` is the run's model on the meta device, before anything is built
        (`hf_ccl.methods.sizes`), or the real model before the method changes it."""

    def on_task_start(self, context: TaskContext) -> None:
        """Called before a task trains. To change the model, assign `context.model`; to change the tokenizer, call
        `context.replace_tokenizer`."""

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        """The dataset this task trains on (default: the task's own train split)."""
        return dataset

    def reference_data(self, context: TaskContext) -> ReferenceData | None:
        """Images and texts from outside the stream the method reads at every step (ZSCL's reference set), or None.
        The loop batches them with the task's collator (`hf_ccl.data.reference`); `loss_terms` reads the step's batch
        with `context.reference_batch(self)`."""
        return None

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        """TrainingArguments fields to change for this task, given the ones the loop would use (`training`, which
        already holds `max_steps` when the run has a compute budget). Return only the changed fields."""
        return {}

    def collator_options(self, context: TaskContext) -> dict[str, Any]:
        """Extra keyword arguments for this task's `CLIPCollator`s (training and task-end), e.g. a second text
        column tokenized for a teacher. Merged over all methods in order."""
        return {}

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        """Extra loss terms, already weighted; the total loss is the contrastive loss plus their sum."""
        return {}

    def no_weight_decay(self, model: ContinualDualEncoder) -> set[str]:
        """Names of model parameters the task's optimizer must not decay (its decoupled weight decay is 0 for them),
        e.g. because the method applies its own decay in `pre_optimizer_step` (TEIR's per-row decay)."""
        return set()

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """Method-owned tensors (not parameters of the model) that the task's optimizer also trains, in their own
        group without weight decay, e.g. CLL-CLIP's learnable temperature. They are not gradient-clipped with the
        model's parameters. Return the same objects every task: the optimizer (and a resumed optimizer state)
        refers to them, so a method restores their values in place."""
        return []

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """Edit `p.grad` of the model's parameters before the optimizer steps (after clipping).

        `context.optimizer` is then the task's optimizer (the torch optimizer, before Accelerate wraps it) and
        `context.training_args` its `TrainingArguments`."""

    def post_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """Edit the model's parameters right after `optimizer.step()` (before the LR scheduler steps and the
        gradients are zeroed), e.g. to project the update the optimizer actually made (DNS `project="update"`)."""

    def after_training(self, context: TaskContext) -> None:
        """Called after a task has trained, before it is evaluated: assign `context.model` to deploy another model
        (evaluated, saved and continued from) instead of the trained one."""

    def on_task_end(self, context: TaskContext) -> None:
        """Called after a task has trained and been evaluated, before its checkpoint is written.

        `context.train_dataset` (what the task trained on), `context.collator` (an eval-mode `CLIPCollator`) and
        `context.per_device_batch_size` are then set.
        """

    def metrics(self) -> Mapping[str, float | torch.Tensor]:
        """Diagnostics to log beside the loss (not added to it), e.g. the fraction of rows Mod-X keeps;
        averaged over the steps of each logging window and logged as `<method>/<name>`.

        Called every training step: a value computed on the device is returned as a one-element tensor (detached),
        not read with `float()` or `.item()` (a host sync every step); the trainer sums it on the device and reads
        it once per logging step. Python numbers are for values the host already has."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: tensors (saved as safetensors) and JSON-serialisable values."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"
