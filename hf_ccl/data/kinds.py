"""Task kinds: what a task of each kind needs, how it is batched, what it trains and how it is scored.

A `Task` names its kind by a string (`Task.kind`, as stored in datasets rows, configs and saved JSON); the code asks
the kind object (`Task.kind_spec`) for behaviour and never compares names. The built-in kinds:

| kind             | rows                              | trains                          | scored by              |
|------------------|-----------------------------------|---------------------------------|------------------------|
| `retrieval`      | the canonical columns, captions   | the towers (`ModelPart.TOWERS`) | Recall@K (`R_mean`)    |
| `classification` | the canonical columns, class labels | the towers                    | zero-shot `accuracy`   |
| `pair`           | two modalities' columns (CMCL)    | learner heads on cached features (`ModelPart.LEARNER_HEADS`) | `R@1` |

A new kind is one subclass, registered like a method (`hf_ccl.methods.registry`):

    @register_task_kind
    class AudioKind(RetrievalKind):
        name = "audio"
        headline_metric = "R@1"

        def evaluate(self, model, task, setup): ...
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ..validation import ConfigError

if TYPE_CHECKING:
    import torch

    from .task import Task

#: The columns of every image-text task (`hf_ccl.data.task`).
CANONICAL_COLUMNS = ("image", "texts", "image_id", "label")


class ModelPart(enum.Enum):
    """What a task trains, and so how its batches reach the model."""

    #: The dual encoder's towers, on raw image-text batches (`hf_ccl.data.collate.CLIPCollator`): the image cache,
    #: the exact contrastive accumulation and the spatial-disorder diagnostics apply.
    TOWERS = "towers"
    #: Per-modality learner heads on the frozen towers' features, encoded once per run (`hf_ccl.pair_features`;
    #: CMCL). A method must attach the heads (`ContinualMethod.attaches`), the towers stay frozen, and a step is one
    #: micro-batch.
    LEARNER_HEADS = "learner_heads"


@dataclass
class CollatorSetup:
    """What a kind's collators are built from, for one task of a run (`TaskKind.collators`)."""

    image_processor: Any
    tokenizer: Any
    max_length: int
    seed: int
    num_workers: int = 0
    padding: str = "longest"
    #: Collator options the methods and the loss asked for (`ContinualMethod.collator_options`, `class_labels`).
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class EvalSetup:
    """What a kind's evaluation reads besides the model and the task (`TaskKind.evaluate`)."""

    image_processor: Any
    tokenizer: Any
    batch_size: int = 256
    max_length: int | None = None
    chunk_size: int = 1024
    #: An `hf_ccl.evaluation.cache.CacheSession` of this model, or None.
    cache: Any = None
    #: The classes a task with classes is also scored among (the `"seen"` scope, `seen_accuracy`), or None.
    seen_class_names: Sequence[str] | None = None


Collator = Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]


class TaskKind:
    """One kind of task. Subclass it (or a built-in kind), set the class attributes, override what differs, and
    register it with `@register_task_kind`."""

    name: ClassVar[str] = ""
    #: How a task of this kind is scored, in words (the model card's evaluation protocol).
    description: ClassVar[str] = ""
    #: The metric placed in the results matrix for a task of this kind (`evaluate` must return it).
    headline_metric: ClassVar[str] = ""
    #: The headline in the `"seen"` class scope (scored among the classes of every task trained so far), for kinds
    #: with classes; None: the scope does not change it.
    seen_headline_metric: ClassVar[str | None] = None
    #: What a task of this kind trains (`ModelPart`).
    trains: ClassVar[ModelPart] = ModelPart.TOWERS
    #: Tasks have `class_names` and labelled rows: class prompts (the cross-entropy loss), the `"seen"` class scope,
    #: prompt-template ensembles and class-stratified eval subsamples apply.
    has_classes: ClassVar[bool] = False
    #: Tasks name two modalities (`Task.modalities`) and the columns holding them.
    has_modalities: ClassVar[bool] = False

    @property
    def has_images(self) -> bool:
        """Whether rows carry images the model's towers read (an image cache and image-text diagnostics apply)."""
        return self.trains is ModelPart.TOWERS

    def headline(self, class_scope: str = "task") -> str:
        """The headline metric of a task of this kind under `class_scope` (`ContinualArguments.class_scope`)."""
        return self.seen_headline_metric if class_scope == "seen" and self.seen_headline_metric else self.headline_metric

    def required_columns(self, task: Task) -> tuple[str, ...]:
        """The columns both splits of `task` must have."""
        return tuple(task.columns) if self.has_modalities and task.columns is not None else CANONICAL_COLUMNS

    def check_task(self, task: Task) -> None:
        """Refuse (ValueError, one line) a task whose fields do not fit the kind, when the task is made."""
        if self.has_classes and not task.class_names:
            raise ValueError(f"Task {task.name!r}: a {self.name} task needs class_names")
        if self.has_modalities != (task.modalities is not None):
            raise ValueError(f"Task {task.name!r}: a pair task, and only a pair task, names its two modalities "
                             f"(kind {self.name!r} {'needs' if self.has_modalities else 'takes no'} modalities)")

    def chance_level(self, examples: int | None, classes: int | None) -> float | None:
        """The headline score (%) of a random guess on `examples` eval rows among `classes`; None if not known."""
        return None

    def selection_score(self, metrics: Mapping[str, float]) -> float:
        """The number a model is chosen by among candidates on a task of this kind (Patching's alpha): the headline."""
        return float(metrics[self.headline_metric])

    def collators(self, task: Task, setup: CollatorSetup) -> tuple[Collator, Collator]:
        """The task's training collator and its eval-mode twin (what task-end hooks run the model over): image-text
        batches of `hf_ccl.data.collate.CLIPCollator`."""
        from .collate import CLIPCollator  # torch: loaded when a run batches, not when a task is made

        common: dict[str, Any] = {"max_length": setup.max_length, "seed": setup.seed, "padding": setup.padding,
                                  **setup.options}
        return (CLIPCollator(setup.image_processor, setup.tokenizer, train=True, num_workers=setup.num_workers,
                             **common),
                CLIPCollator(setup.image_processor, setup.tokenizer, train=False, **common))

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        """Every metric of `model` on `task.eval`, the headline included."""
        raise NotImplementedError(f"task kind {self.name!r} does not say how its tasks are evaluated (TaskKind.evaluate)")

    def __repr__(self) -> str:
        return f"<task kind {self.name!r}>"


TASK_KINDS: dict[str, TaskKind] = {}


def register_task_kind(cls: type[TaskKind]) -> type[TaskKind]:
    """Class decorator: make a task kind available by its `name` (`Task(kind=name)`)."""
    if not cls.name or not cls.headline_metric:
        raise ValueError(f"{cls.__name__} needs a `name` and a `headline_metric` to be registered")
    if cls.name in TASK_KINDS and type(TASK_KINDS[cls.name]) is not cls:
        raise ValueError(f"A task kind named {cls.name!r} is already registered "
                         f"({type(TASK_KINDS[cls.name]).__name__})")
    TASK_KINDS[cls.name] = cls()
    return cls


def unregister_task_kind(name: str) -> None:
    """Remove a kind registered by `register_task_kind` (a test's or a plugin's own)."""
    TASK_KINDS.pop(name, None)


def available_task_kinds() -> list[str]:
    return sorted(TASK_KINDS)


def find_task_kind(name: Any) -> TaskKind | None:
    """The registered kind named `name`, or None (a kind named in a saved file that this process has not registered)."""
    return TASK_KINDS.get(name) if isinstance(name, str) else None


def get_task_kind(name: str, where: str = "") -> TaskKind:
    """The registered kind named `name`; an unknown name is refused in one line (after `where`) naming the valid
    ones."""
    kind = find_task_kind(name)
    if kind is None:
        raise ConfigError(f"{where}unknown task kind {name!r}; valid kinds: {', '.join(available_task_kinds())} "
                          "(a new one is registered with hf_ccl.data.kinds.register_task_kind)")
    return kind


# ----- the built-in kinds ------------------------------------------------------------------------------------------
@register_task_kind
class RetrievalKind(TaskKind):
    """Captioned image-text tasks, scored by image-text Recall@K over every caption."""

    name = "retrieval"
    description = "image-text retrieval"
    headline_metric = "R_mean"

    def chance_level(self, examples: int | None, classes: int | None) -> float | None:
        """R_mean's: the mean of K/N over K = 1, 5, 10 with N eval examples (one caption per image)."""
        return 100.0 * sum(min(k, examples) / examples for k in (1, 5, 10)) / 3 if examples else None

    def selection_score(self, metrics: Mapping[str, float]) -> float:
        """R@1, the mean of both directions."""
        return (float(metrics["i2t_R@1"]) + float(metrics["t2i_R@1"])) / 2.0

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        from ..evaluation.evaluator import evaluate_retrieval

        return evaluate_retrieval(model, task, setup)


@register_task_kind
class ClassificationKind(TaskKind):
    """Class-label tasks, scored by zero-shot classification over `class_names` with a template ensemble (caption
    retrieval is ill-defined when many captions are identical)."""

    name = "classification"
    description = "zero-shot classification"
    headline_metric = "accuracy"
    seen_headline_metric = "seen_accuracy"
    has_classes = True

    def chance_level(self, examples: int | None, classes: int | None) -> float | None:
        """Accuracy's: 100 / classes."""
        return 100.0 / classes if classes else None

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        from ..evaluation.evaluator import evaluate_classification

        return evaluate_classification(model, task, setup)


@register_task_kind
class PairKind(TaskKind):
    """CMCL's modality-pair tasks: learner heads trained on the frozen CLIP's cached features of two modalities,
    scored by Recall@K between them."""

    name = "pair"
    description = "modality-pair retrieval (learner heads)"
    headline_metric = "R@1"
    trains = ModelPart.LEARNER_HEADS
    has_modalities = True

    def collators(self, task: Task, setup: CollatorSetup) -> tuple[Collator, Collator]:
        """Batches of the task's cached features (`hf_ccl.pair_features.PairFeatureCollator`)."""
        if setup.options:
            raise ValueError(f"pair task {task.name!r} is batched from cached features: collator options "
                             f"{sorted(setup.options)} cannot apply")
        from ..pair_features import PairFeatureCollator

        assert task.modalities is not None  # check_task
        collator = PairFeatureCollator(task.modalities)
        return collator, collator

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        from ..evaluation.pairs import evaluate_pair_task

        return evaluate_pair_task(model, task)
