"""Evaluation of pair tasks (CMCL's setting): Recall@K in both directions between the two modalities' learner
outputs (spec cmcl.md §5, Eq. 12) and the drift of old alignment matrices (Def. 1, Eq. 4).

Scores are the heads' similarity of the learner outputs (raw inner products for the paper's `dot`), and each query
has exactly one positive (row i ↔ row i). Ties count in expectation, as in `recall_at_k`. `cos_*` metrics score
cosines, what a CLIP with the heads folded into its projections computes. Before any head exists (the initial row)
the heads are the identity: the scores are the frozen features' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.func import functional_call

from ..heads import pair_logits
from .checks import check_finite_embeddings
from .retrieval import RankCounts, hit_rate, single_positive_rank_counts

KS = (1, 5, 10)


def diagonal_rank_counts(scores: torch.Tensor) -> RankCounts:
    """Where the diagonal entry of each row of a square score matrix stands among its row."""
    return single_positive_rank_counts(scores, scores.diagonal().unsqueeze(1))


def pair_recall(scores: torch.Tensor, ks: Sequence[int] = KS, prefix: str = "") -> dict[str, float]:
    """`a2b_R@K` (rows query columns), `b2a_R@K` and `R@K` (their mean), in percent, for a square score matrix;
    ties count in expectation (`hit_rate`)."""
    metrics: dict[str, float] = {}
    counts = {"a2b": diagonal_rank_counts(scores), "b2a": diagonal_rank_counts(scores.T)}
    for k in ks:
        for direction, direction_counts in counts.items():
            metrics[f"{prefix}{direction}_R@{k}"] = 100.0 * hit_rate(direction_counts, k).mean().item()
        metrics[f"{prefix}R@{k}"] = (metrics[f"{prefix}a2b_R@{k}"] + metrics[f"{prefix}b2a_R@{k}"]) / 2
    return metrics


def learner_outputs(heads: Any, task: Any, split: Any, state: dict[str, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_a, z_b) of an encoded split's rows: the heads' outputs (with `state`: the heads as they were then), or
    the features themselves when there are no heads yet."""
    rows = split.with_format("torch")[:]
    features_a, features_b = rows["features_a"].float(), rows["features_b"].float()
    if heads is None:
        return features_a, features_b
    modality_a, modality_b = task.modalities
    parameter = next(heads.parameters(), None)
    if modality_a not in heads.heads or modality_b not in heads.heads or parameter is None:
        return features_a, features_b  # heads not made yet: the identity
    inputs = (modality_a, modality_b, features_a.to(parameter), features_b.to(parameter), False)
    with torch.no_grad():
        output = heads(*inputs) if state is None else functional_call(heads, state, inputs)
    return output.z_a.float(), output.z_b.float()


def relative_drift(current: torch.Tensor, reference: torch.Tensor) -> float:
    """‖A_{i;t} − A_{i;i}‖_F / ‖A_{i;i}‖_F (spec §5, stability diagnostic)."""
    norm = reference.norm()
    return float((current - reference).norm() / norm) if norm > 0 else float((current - reference).norm())


def alignment_drift(heads: Any, task: Any) -> float | None:
    """Def. 1's drift of `task`'s train alignment matrix A = Z_a Z_bᵀ from right after it was learned (None before
    it was)."""
    if heads is None or task.name not in heads.snapshots:
        return None
    z_a, z_b = learner_outputs(heads, task, task.train)
    then_a, then_b = learner_outputs(heads, task, task.train, {
        name: tensor.to(z_a.device) for name, tensor in heads.snapshots[task.name].items()})
    return relative_drift(z_a.double() @ z_b.double().T, then_a.double() @ then_b.double().T)


def evaluate_pair_task(model: Any, task: Any) -> dict[str, float]:
    """Recall@K of an encoded pair task's eval rows under `model.learner_heads` (its similarity, and `cos_`
    cosines), and `drift` once the task was learned."""
    heads = getattr(model, "learner_heads", None)
    similarity = heads.similarity if heads is not None else "dot"
    z_a, z_b = learner_outputs(heads, task, task.eval)
    for z, modality in zip((z_a, z_b), task.modalities, strict=True):
        check_finite_embeddings(z, f"{modality} learner outputs")
    metrics = pair_recall(pair_logits(z_a, z_b, 1.0, similarity))
    if similarity != "cosine":
        metrics.update(pair_recall(pair_logits(z_a, z_b, 1.0, "cosine"), prefix="cos_"))
    drift = alignment_drift(heads, task)
    if drift is not None:
        metrics["drift"] = drift
    return metrics
