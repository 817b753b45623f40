"""Evaluating a model whose prediction averages the class scores of several of its variants (ConDU's decoupled task
experts and its semantic voting).

A module of the model that implements `EvaluationEnsemble` (`hf_ccl.methods.condu.ConDUExperts`) gives, from the
frozen model's embedding of every eval image and the evaluated task's name (None under the task-agnostic class scopes,
`seen` / `all`: X-TAIL gives no domain identity), a weight per image for each variant (route -1: the frozen model;
route r: variant r). The evaluator then scores the images with every variant that some
image weighs (its own image AND class-prompt embeddings, the class prompts encoded once per variant), and ranks the
classes of each image by the weighted sum of the variants' cosine similarities (`ensemble_scores`). A one-hot weight
is a route (the task's own expert); equal weights over k variants are the mean of their scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class EvaluationEnsemble(Protocol):
    """What the evaluator needs of a model that averages its variants' scores (found among the model's modules)."""

    def ensemble_weights(self, frozen_image_embeds: torch.Tensor, task_name: str | None) -> torch.Tensor | None:
        """Weights [N, R + 1] of N images (normalised frozen embeddings) over the routes -1, 0, ..., R - 1 (column
        j is route j - 1) when evaluating task `task_name` (None: the task is not known), or None to evaluate the
        model as it is."""

    def evaluation_route(self, model: nn.Module, route: int) -> AbstractContextManager[None]:
        """A block inside which `model` is variant `route` (-1: the frozen model)."""


def evaluation_ensemble(model: nn.Module) -> EvaluationEnsemble | None:
    """The model's evaluation ensemble, or None (the usual case: the model is scored as it is)."""
    return next((module for module in model.modules() if isinstance(module, EvaluationEnsemble)), None)


def ensemble_scores(
    model: nn.Module,
    ensemble: EvaluationEnsemble,
    encode_images: Callable[[], torch.Tensor],
    class_embeddings: Callable[[list[str]], torch.Tensor],
    candidates: Sequence[tuple[list[str], str | None]],
) -> list[torch.Tensor] | None:
    """Class scores [N, C] of the eval images for each candidate (class names, the task's name or None):
    Σ_r w[n, r] · cos(image_r[n], class_r[c]) with that candidate's weights (`ensemble_weights`) over the routes r
    that some image weighs, or None when the ensemble does not apply (weights None).

    `encode_images()`: the eval images' embeddings under the current variant (not normalised);
    `class_embeddings(names)`: the normalised class embeddings of `names` under the current variant."""
    with ensemble.evaluation_route(model, -1):
        frozen = encode_images()
    normalised = nn.functional.normalize(frozen.float(), dim=-1)
    checked: list[torch.Tensor] = []
    for _, task_name in candidates:
        w = ensemble.ensemble_weights(normalised, task_name)
        if w is None:
            return None
        if w.shape[0] != frozen.shape[0]:
            raise RuntimeError(f"{type(ensemble).__name__}.ensemble_weights gave {w.shape[0]} rows for "
                               f"{frozen.shape[0]} images")
        checked.append(w.float().cpu())
    scores = [torch.zeros(frozen.shape[0], len(names)) for names, _ in candidates]
    used = torch.stack([w.abs().sum(dim=0) for w in checked]).sum(dim=0)
    for column in torch.nonzero(used).flatten().tolist():
        with ensemble.evaluation_route(model, column - 1):
            images = frozen if column == 0 else encode_images()
            images = nn.functional.normalize(images.float(), dim=-1).cpu()
            for total, w, (names, _) in zip(scores, checked, candidates, strict=True):
                if w[:, column].any():
                    total += w[:, column : column + 1] * (images @ class_embeddings(list(names)).float().cpu().T)
    return scores
