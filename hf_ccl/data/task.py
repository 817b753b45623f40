"""Tasks and task streams: the unit of a continual run.

Every task holds two Hugging Face datasets (train and eval) in one canonical schema, whatever the source:

| column     | type                          | meaning                                                          |
|------------|-------------------------------|------------------------------------------------------------------|
| `image`    | `datasets.Image(decode=False)`| the encoded image (bytes/path); decoded by the collator so that a |
|            |                               | corrupt file raises an error naming dataset, split and row        |
| `texts`    | `list[str]` (at least one)    | every caption of the image; for class-label tasks the label put   |
|            |                               | through the task's training templates                             |
| `image_id` | `str`                         | unique per image across the stream: `"<source>/<split>/<row>"`    |
| `label`    | `int`                         | class index into `Task.class_names`, or -1 for captioned tasks    |

Training samples one caption of `texts` per example and step; evaluation uses all of them.

A *pair task* (`kind="pair"`, CMCL's setting) aligns two named modalities instead: `modalities=(a, b)` names the
learner heads (`hf_ccl.heads`), `columns` the dataset columns holding each side's raw value (an image cell, a
caption, a feature vector; default the modality names). One row is one pair; its frozen features are encoded once
(`hf_ccl.data.pair_features`). A task's `train` may be a
streaming `datasets.IterableDataset` with the same columns (see `hf_ccl.data.streaming`); `eval` is always a `Dataset`.

Rows a builder leaves out are counted on the stream (`TaskStream.dropped`, see `hf_ccl.data.dropped`).

A task's kind is a registered `TaskKind` (the contract and its registry are here, beside `Task`; the built-in kinds
in `hf_ccl.data.kinds`): code asks `task.kind_spec` for behaviour and never compares kind names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from datasets import Dataset, IterableDataset

from ..validation import ConfigError

if TYPE_CHECKING:
    import torch

CANONICAL_COLUMNS = ("image", "texts", "image_id", "label")
#: The key of `TaskStream.dropped` for rows that fall in no task.
NO_TASK = "(no task)"


@dataclass
class Task:
    """One step of a continual stream.

    `kind` names a registered task kind (`hf_ccl.data.kinds`; `kind_spec` is the kind object, which says how the
    task is checked, batched, trained and scored): captioned tasks by image-text retrieval (Recall@K), class-label
    tasks by zero-shot classification over `class_names` with the prompt-template ensemble `eval_templates`
    (DESIGN.md: caption-level retrieval is ill-defined when many captions are identical); pair tasks by Recall@K
    between their two modalities (`modalities`, anchor first; see the module docstring).
    """

    name: str
    train: Dataset | IterableDataset  # a stream (hf_ccl.data.streaming) when the task's data is read as it comes
    eval: Dataset
    kind: str = "retrieval"
    class_names: list[str] | None = None
    eval_templates: list[str] | None = None
    source: str = ""
    #: The templates a classification task's labels were put through for its training captions (None: the
    #: default `("a photo of a {label}.",)`); the class prompts of the cross-entropy loss (`hf_ccl.class_prompts`).
    train_templates: list[str] | None = None
    #: Rows of this task's selection the builder left out: split ("train"/"eval") -> reason -> rows. A train split
    #: streamed from its source is not counted (rows are skipped as they are read).
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    modalities: tuple[str, str] | None = None
    columns: tuple[str, str] | None = None
    #: The Hub dataset (`owner/name`) the eval split was read from and the commit it was read at (None: not pinned);
    #: None for bundled, local or in-memory data. `.eval_results` lists only tasks with one (`hf_ccl.eval_results`).
    dataset_id: str | None = None
    dataset_revision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or not self.name.isprintable():
            raise ValueError(f"Task name {self.name!r} must be a non-empty line of printable text (it names the task "
                             "in results, cards and branches): name the task (e.g. the builder's `names`) or clean "
                             "the column value it came from")
        get_task_kind(self.kind, where=f"Task {self.name!r}: ").check_task(self)
        if self.dataset_id is not None and (not isinstance(self.dataset_id, str) or not self.dataset_id
                                            or any(c.isspace() for c in self.dataset_id)):
            raise ValueError(f"Task {self.name!r}: dataset_id must be a Hub dataset id, got {self.dataset_id!r}")
        if self.dataset_revision is not None and self.dataset_id is None:
            raise ValueError(f"Task {self.name!r}: dataset_revision {self.dataset_revision!r} without a dataset_id")
        if self.modalities is not None:
            self.modalities = self._two_names("modalities", self.modalities)
            if self.modalities[0] == self.modalities[1]:
                raise ValueError(f"Task {self.name!r} pairs modality {self.modalities[0]!r} with itself")
            self.columns = self._two_names("columns", self.columns or self.modalities)

    def _two_names(self, field_name: str, value: object) -> tuple[str, str]:
        names = tuple(value) if isinstance(value, (tuple, list)) else ()
        if len(names) != 2 or not all(isinstance(m, str) and m for m in names):
            raise ValueError(f"Task {self.name!r}: {field_name} must be two names, got {value!r}")
        return names[0], names[1]

    @property
    def kind_spec(self) -> TaskKind:
        """The task's kind (`hf_ccl.data.kinds.TaskKind`): ask it, rather than compare `kind` to a name."""
        return get_task_kind(self.kind)

    @property
    def headline_metric(self) -> str:
        """The metric placed in the results matrix for this task."""
        return self.kind_spec.headline_metric

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The columns both splits must have: the canonical ones, or a pair task's two modality columns."""
        return self.kind_spec.required_columns(self)


@dataclass
class TaskStream:
    """An ordered list of tasks.

    `unassigned` counts the rows of the source that fall in no task (after the last time step, a column value or
    class in no task, no text before a random split): split -> reason -> rows.
    """

    name: str
    tasks: list[Task] = field(default_factory=list)
    unassigned: dict[str, dict[str, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __getitem__(self, index: int) -> Task:
        return self.tasks[index]

    @property
    def task_names(self) -> list[str]:
        return [task.name for task in self.tasks]

    @property
    def kinds(self) -> list[TaskKind]:
        """The kinds of the stream's tasks, each once, in order of first appearance."""
        return list(dict.fromkeys(task.kind_spec for task in self.tasks))

    @property
    def modalities(self) -> list[str]:
        """Every modality of the stream's pair tasks, in order of first appearance."""
        return list(dict.fromkeys(m for task in self.tasks for m in task.modalities or ()))

    @property
    def dropped(self) -> dict[str, dict[str, dict[str, int]]]:
        """Every row the builder left out, JSON-ready: task name (`NO_TASK` for rows in no task) -> split -> reason
        -> rows. Tasks and splits without dropped rows are left out."""
        report = {task.name: task.dropped for task in self.tasks if any(task.dropped.values())}
        if any(self.unassigned.values()):
            report[NO_TASK] = self.unassigned
        return report


# ----- task kinds: the contract and the registry (the built-in kinds: hf_ccl.data.kinds) ----------------------------
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
    #: The classes a task with classes is also scored among (the `"seen"` scope, `seen_accuracy`; the `"all"` scope,
    #: `all_accuracy`), or None.
    seen_class_names: Sequence[str] | None = None
    #: The scope `seen_class_names` come from, the prefix of the metrics scored among them (`seen_accuracy`).
    class_scope: str = "seen"


Collator = Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]


class TaskKind:
    """One kind of task. Subclass it (or a built-in kind), set the class attributes, override what differs, and
    register it with `@register_task_kind`. The built-in kinds are in `hf_ccl.data.kinds`."""

    name: ClassVar[str] = ""
    #: How a task of this kind is scored, in words (the model card's evaluation protocol).
    description: ClassVar[str] = ""
    #: The metric placed in the results matrix for a task of this kind (`evaluate` must return it).
    headline_metric: ClassVar[str] = ""
    #: The headline in the `"seen"` class scope (scored among the classes of every task trained so far), for kinds
    #: with classes; None: the scope does not change it.
    seen_headline_metric: ClassVar[str | None] = None
    #: The headline in the `"all"` class scope (scored among the classes of every task of the stream: X-TAIL).
    all_headline_metric: ClassVar[str | None] = None
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
        scoped = {"seen": self.seen_headline_metric, "all": self.all_headline_metric}.get(class_scope)
        return scoped or self.headline_metric

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
        """The task's training collator and its eval-mode twin (what task-end hooks run the model over)."""
        raise NotImplementedError(f"task kind {self.name!r} does not say how its tasks are batched (TaskKind.collators)")

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        """Every metric of `model` on `task.eval`, the headline included."""
        raise NotImplementedError(f"task kind {self.name!r} does not say how its tasks are evaluated (TaskKind.evaluate)")

    def __repr__(self) -> str:
        return f"<task kind {self.name!r}>"


TASK_KINDS: dict[str, TaskKind] = {}


_Kind = TypeVar("_Kind", bound=TaskKind)


def register_task_kind(cls: type[_Kind]) -> type[_Kind]:
    """Class decorator: make a task kind available by its `name` (`Task(kind=name)`); one instance serves every task
    of the kind."""
    if not cls.name or not cls.headline_metric:
        raise ValueError(f"{cls.__name__} needs a `name` and a `headline_metric` to be registered")
    if cls.name in TASK_KINDS and type(TASK_KINDS[cls.name]) is not cls:
        raise ValueError(f"A task kind named {cls.name!r} is already registered "
                         f"({type(TASK_KINDS[cls.name]).__name__})")
    if cls.name not in TASK_KINDS:
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
                          "(a new one is registered with hf_ccl.data.register_task_kind)")
    return kind
