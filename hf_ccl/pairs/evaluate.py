"""Evaluation of learner heads on modality-pair tasks: Recall@K in both directions (spec cmcl.md §5, Eq. 12) and
the drift of old alignment matrices (Def. 1, Eq. 4).

Scores are the objective's similarity of the learner outputs (raw inner products for the paper's `dot`), and each
query has exactly one positive (row i ↔ row i). Ties count in expectation, as in `hf_ccl.evaluation.recall_at_k`.
`cos_*` metrics score cosines, what a CLIP with the heads folded into its projections computes (`fold_into_clip`).
"""

from __future__ import annotations

import torch

from ..evaluation.pairs import diagonal_rank_counts, pair_recall, relative_drift
from .heads import LearnerHeads, pair_logits
from .objective import PairObjective

__all__ = ["alignment_matrix", "diagonal_rank_counts", "evaluate_pair", "pair_recall", "relative_drift"]


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
