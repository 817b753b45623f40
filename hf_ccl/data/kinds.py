"""Task kinds: what a task of each kind needs, how it is batched, what it trains and how it is scored.

A `Task` names its kind by a string (`Task.kind`, as stored in datasets rows, configs and saved JSON); the code asks
the kind object (`Task.kind_spec`) for behaviour and never compares names. The built-in kinds:

| kind             | rows                              | trains                          | scored by              |
|------------------|-----------------------------------|---------------------------------|------------------------|
| `retrieval`      | the canonical columns, captions   | the towers (`ModelPart.TOWERS`) | Recall@K (`R_mean`)    |
| `classification` | the canonical columns, class labels | the towers                    | zero-shot `accuracy`   |
| `pair`           | two modalities' columns (CMCL)    | learner heads on cached features (`ModelPart.LEARNER_HEADS`) | `R@1` |

The contract (`TaskKind`, `ModelPart`) and the registry live beside `Task` (`hf_ccl.data.task`) and are re-exported
here. A new kind is one subclass, registered like a method (`hf_ccl.methods.registry`):

    @register_task_kind
    class AudioKind(RetrievalKind):
        name = "audio"
        headline_metric = "R@1"

        def evaluate(self, model, task, setup): ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .task import (
    CANONICAL_COLUMNS,
    TASK_KINDS,
    Collator,
    CollatorSetup,
    EvalSetup,
    ModelPart,
    Task,
    TaskKind,
    available_task_kinds,
    find_task_kind,
    get_task_kind,
    register_task_kind,
    unregister_task_kind,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CANONICAL_COLUMNS",
    "TASK_KINDS",
    "ClassificationKind",
    "Collator",
    "CollatorSetup",
    "EvalSetup",
    "ImageTextKind",
    "ModelPart",
    "PairKind",
    "RetrievalKind",
    "TaskKind",
    "available_task_kinds",
    "find_task_kind",
    "get_task_kind",
    "register_task_kind",
    "unregister_task_kind",
]


# ----- the built-in kinds ------------------------------------------------------------------------------------------
class ImageTextKind(TaskKind):
    """Tasks of images and captions (the canonical columns) that train the towers: batched by `CLIPCollator`."""

    def collators(self, task: Task, setup: CollatorSetup) -> tuple[Collator, Collator]:
        """Image-text batches of `hf_ccl.data.collate.CLIPCollator`, in train mode and in eval mode."""
        from .collate import CLIPCollator  # torch: loaded when a run batches, not when a task is made

        common: dict[str, Any] = {"max_length": setup.max_length, "seed": setup.seed, "padding": setup.padding,
                                  **setup.options}
        return (CLIPCollator(setup.image_processor, setup.tokenizer, train=True, num_workers=setup.num_workers,
                             **common),
                CLIPCollator(setup.image_processor, setup.tokenizer, train=False, **common))


@register_task_kind
class RetrievalKind(ImageTextKind):
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
class ClassificationKind(ImageTextKind):
    """Class-label tasks, scored by zero-shot classification over `class_names` with a template ensemble (caption
    retrieval is ill-defined when many captions are identical)."""

    name = "classification"
    description = "zero-shot classification"
    headline_metric = "accuracy"
    seen_headline_metric = "seen_accuracy"
    all_headline_metric = "all_accuracy"
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
