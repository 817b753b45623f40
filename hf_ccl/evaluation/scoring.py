"""Scoring eval images against class names with something other than cosine similarity (RAIL's fused scores, LADA's
label-specific features).

A module of the model that implements `EvaluationScorer` turns the evaluated model's image embeddings, the zero-shot
class embeddings and the candidate class names into class scores. The evaluator then ranks the candidates by those
scores instead of by cosine similarity (`hf_ccl.evaluation.evaluator.evaluate_classification`), for the task's own
classes and, under the task-agnostic protocols, for every candidate class. Scores are computed after the embedding
cache (`hf_ccl.evaluation.cache`), so a scorer whose state changed never reads stale scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class EvaluationScorer(Protocol):
    """What the evaluator needs of a model that scores classes its own way (found among the model's modules)."""

    def class_scores(self, image_embeds: torch.Tensor, class_embeds: torch.Tensor,
                     class_names: Sequence[str]) -> torch.Tensor | None:
        """Scores [N, C] of N images against C candidate classes, higher is better, or None to fall back to cosine
        similarity (e.g. before the first task is learned).

        `image_embeds` [N, D]: the evaluated model's projected image embeddings, not normalised. `class_embeds`
        [C, D]: the normalised zero-shot class embeddings (prompt-ensemble means). `class_names`: the C candidates
        in column order (the identity a scorer keys its learned classes by)."""


def evaluation_scorer(model: nn.Module) -> EvaluationScorer | None:
    """The model's evaluation scorer, or None (the usual case: cosine similarity)."""
    return next((module for module in model.modules() if isinstance(module, EvaluationScorer)), None)
