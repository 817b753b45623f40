"""The pair loss as one object the trainer and the methods share (Eq. 2; spec cmcl.md §2.1, A10)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .heads import LearnerHeads, pair_contrastive_loss, pair_logits


@dataclass(frozen=True)
class PairObjective:
    """Eq. (2) on the learner outputs: `temperature` τ, `similarity` ('dot', the paper; 'cosine') and
    `symmetric` (both directions; the paper's loss is one-directional, anchor = the pair's first modality)."""

    temperature: float = 1.0
    similarity: str = "dot"
    symmetric: bool = False

    def logits(
        self,
        heads: LearnerHeads | torch.nn.Module,
        modality_a: str,
        modality_b: str,
        xa: torch.Tensor,
        xb: torch.Tensor,
    ) -> torch.Tensor:
        """[n_a, n_b] scores between the two heads' outputs."""
        z_a, z_b = heads(modality_a, xa, modality_b, xb)  # one forward call: `heads` may be DDP-wrapped
        return pair_logits(z_a, z_b, self.temperature, self.similarity)

    def __call__(
        self,
        heads: LearnerHeads | torch.nn.Module,
        modality_a: str,
        modality_b: str,
        xa: torch.Tensor,
        xb: torch.Tensor,
    ) -> torch.Tensor:
        """The pair loss of aligned rows `xa[i] ↔ xb[i]`."""
        return pair_contrastive_loss(self.logits(heads, modality_a, modality_b, xa, xb), self.symmetric)
