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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from datasets import Dataset, IterableDataset

from .kinds import CANONICAL_COLUMNS, TASK_KINDS, TaskKind, get_task_kind

__all__ = ["CANONICAL_COLUMNS", "NO_TASK", "TASK_KINDS", "Task", "TaskKind", "TaskStream"]

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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip() or not self.name.isprintable():
            raise ValueError(f"Task name {self.name!r} must be a non-empty line of printable text (it names the task "
                             "in results, cards and branches): name the task (e.g. the builder's `names`) or clean "
                             "the column value it came from")
        get_task_kind(self.kind, where=f"Task {self.name!r}: ").check_task(self)
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
