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
from typing import Literal

from datasets import Dataset, IterableDataset

CANONICAL_COLUMNS = ("image", "texts", "image_id", "label")
#: The key of `TaskStream.dropped` for rows that fall in no task.
NO_TASK = "(no task)"
TaskKind = Literal["retrieval", "classification", "pair"]
TASK_KINDS = ("retrieval", "classification", "pair")


@dataclass
class Task:
    """One step of a continual stream.

    `kind` says how the task is scored: captioned tasks by image-text retrieval (Recall@K), class-label tasks by
    zero-shot classification over `class_names` with the prompt-template ensemble `eval_templates` (DESIGN.md:
    caption-level retrieval is ill-defined when many captions are identical); pair tasks by Recall@K between their
    two modalities (`modalities`, anchor first; see the module docstring).
    """

    name: str
    train: Dataset | IterableDataset  # a stream (hf_ccl.data.streaming) when the task's data is read as it comes
    eval: Dataset
    kind: TaskKind = "retrieval"
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
        if self.kind not in TASK_KINDS:
            raise ValueError(f"Task {self.name!r}: kind must be one of {list(TASK_KINDS)}, got {self.kind!r}")
        if self.kind == "classification" and not self.class_names:
            raise ValueError(f"Task {self.name!r}: a classification task needs class_names")
        if (self.kind == "pair") != (self.modalities is not None):
            raise ValueError(f"Task {self.name!r}: a pair task, and only a pair task, names its two modalities")
        if self.modalities is not None:
            modalities = tuple(self.modalities)
            if len(modalities) != 2 or not all(isinstance(m, str) and m for m in modalities):
                raise ValueError(f"Task {self.name!r}: modalities must be two names, got {modalities!r}")
            if modalities[0] == modalities[1]:
                raise ValueError(f"Task {self.name!r} pairs modality {modalities[0]!r} with itself")
            self.modalities = (modalities[0], modalities[1])
            columns = tuple(self.columns or modalities)
            if len(columns) != 2:
                raise ValueError(f"Task {self.name!r}: columns must be two names, got {columns!r}")
            self.columns = (columns[0], columns[1])

    @property
    def headline_metric(self) -> str:
        """The metric placed in the results matrix for this task."""
        return {"retrieval": "R_mean", "classification": "accuracy", "pair": "R@1"}[self.kind]

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The columns both splits must have: the canonical ones, or a pair task's two modality columns."""
        return self.columns if self.columns is not None else CANONICAL_COLUMNS


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
