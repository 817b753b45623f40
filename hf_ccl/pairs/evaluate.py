"""Evaluation of learner heads on modality-pair tasks: Recall@K in both directions (spec cmcl.md §5, Eq. 12) and
the drift of old alignment matrices (Def. 1, Eq. 4).

Scores are the objective's similarity of the learner outputs (raw inner products for the paper's `dot`), and each
query has exactly one positive (row i ↔ row i). Ties count in expectation, as in `hf_ccl.evaluation.recall_at_k`.
`cos_*` metrics score cosines, what a CLIP with the heads folded into its projections computes (`fold_into_clip`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..evaluation.retrieval import RankCounts, hit_rate, single_positive_rank_counts
from .heads import LearnerHeads, pair_logits
from .objective import PairObjective

KS = (1, 5, 10)


def diagonal_rank_counts(scores: torch.Tensor) -> RankCounts:
    """Where the diagonal entry of each row of a square score matrix stands among its row."""
    return single_positive_rank_counts(scores, scores.diagonal().unsqueeze(1))


def pair_recall(scores: torch.Tensor, ks: Sequence[int] = KS, prefix: str = "") -> dict[str, float]:
    """`a2b_R@K` (rows query columns), `b2a_R@K` and `R@K` (their mean), in percent, for a square score matrix;
    ties count in expectation (`hf_ccl.evaluation.hit_rate`)."""
    metrics: dict[str, float] = {}
    counts = {"a2b": diagonal_rank_counts(scores), "b2a": diagonal_rank_counts(scores.T)}
    for k in ks:
        for direction, direction_counts in counts.items():
            metrics[f"{prefix}{direction}_R@{k}"] = 100.0 * hit_rate(direction_counts, k).mean().item()
        metrics[f"{prefix}R@{k}"] = (metrics[f"{prefix}a2b_R@{k}"] + metrics[f"{prefix}b2a_R@{k}"]) / 2
    return metrics


@torch.no_grad()
def evaluate_pair(
    heads: LearnerHeads,
    modality_a: str,
    modality_b: str,
    xa: torch.Tensor,
    xb: torch.Tensor,
    objective: PairObjective,
) -> dict[str, float]:
    """Recall@K of a task's test pairs under the heads (with the objective's similarity, and `cos_` cosines)."""
    device = next(heads.parameters()).device
    z_a = heads(modality_a, xa.to(device)).float()
    z_b = heads(modality_b, xb.to(device)).float()
    metrics = pair_recall(pair_logits(z_a, z_b, 1.0, objective.similarity))
    if objective.similarity != "cosine":
        metrics.update(pair_recall(pair_logits(z_a, z_b, 1.0, "cosine"), prefix="cos_"))
    return metrics


@torch.no_grad()
def alignment_matrix(
    heads: LearnerHeads, modality_a: str, modality_b: str, xa: torch.Tensor, xb: torch.Tensor
) -> torch.Tensor:
    """A = Z_aᵀ Z_b with Z = W z* (Sec. 3.1): [n, n] raw inner products of the pairs' learner outputs."""
    device = next(heads.parameters()).device
    z_a, z_b = heads(modality_a, xa.to(device), modality_b, xb.to(device))
    return z_a.double() @ z_b.double().T


def relative_drift(current: torch.Tensor, reference: torch.Tensor) -> float:
    """‖A_{i;t} − A_{i;i}‖_F / ‖A_{i;i}‖_F (spec §5, stability diagnostic)."""
    norm = reference.norm()
    return float((current - reference).norm() / norm) if norm > 0 else float((current - reference).norm())
