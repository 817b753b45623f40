"""Per-modality learner heads on frozen encoders, CMCL's trainable part (spec cmcl.md §2.1, §2.6).

Each modality m has a square linear learner W^m ∈ R^{d×d}, initialised to the identity (App. A.5), so step 0
reproduces the frozen prior exactly: z^m = W^m z*_m (Alg. 2, line 1), z*_m the frozen encoder's output.

The pair loss is Eq. (2), CMCL's one-directional InfoNCE with the pair's first modality as anchor:

    L = −(1/n) Σ_i log softmax_j(z^a_i · z^b_j / τ)_i,

on raw inner products of the learner outputs (the official code's τ = 1 on ImageBind features with built-in
scales; for CLIP features the frozen prior's 1/exp(logit_scale), spec A10). `symmetric=True` averages both
directions (CLIP's loss).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from transformers import CLIPModel

from ..heads import SIMILARITIES, pair_contrastive_loss, pair_logits

__all__ = ["SIMILARITIES", "LearnerHeads", "fold_into_clip", "pair_contrastive_loss", "pair_logits"]


class LearnerHeads(nn.Module):
    """One identity-initialised `nn.Linear(dim, dim)` per modality name (spec §2.1: W^m_1 = I, bias off by
    default, A8). Heads are created on first use by `ensure`, so a stream may bring new modalities."""

    def __init__(self, dim: int, modalities: Iterable[str] = (), bias: bool = False):
        super().__init__()
        if dim < 1:
            raise ValueError(f"head dim must be >= 1, got {dim}")
        self.dim = dim
        self.bias = bias
        self.heads = nn.ModuleDict()
        for name in modalities:
            self.ensure(name)

    def ensure(self, modality: str) -> nn.Linear:
        """The head of `modality`, created as the identity when missing."""
        if not modality or "." in modality:
            raise ValueError(f"modality names must be non-empty and contain no '.', got {modality!r}")
        if modality not in self.heads:
            head = nn.Linear(self.dim, self.dim, bias=self.bias)
            with torch.no_grad():
                head.weight.copy_(torch.eye(self.dim))
                if head.bias is not None:
                    head.bias.zero_()
            reference = next(self.parameters(), None)
            if reference is not None:
                head.to(device=reference.device, dtype=reference.dtype)
            self.heads[modality] = head
        return self.heads[modality]

    def forward(
        self,
        modality: str,
        features: torch.Tensor,
        modality_b: str | None = None,
        features_b: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """z^m = W^m z*_m (Alg. 2 l.1) for row features [n, dim]; given a second modality and its features, both
        outputs (z_a, z_b) from one call, as DDP needs (one forward per backward)."""
        if modality_b is not None:
            if features_b is None:
                raise ValueError("features_b is required with modality_b")
            return self._head_output(modality, features), self._head_output(modality_b, features_b)
        return self._head_output(modality, features)

    def _head_output(self, modality: str, features: torch.Tensor) -> torch.Tensor:
        if modality not in self.heads:
            raise KeyError(f"no learner head for modality {modality!r}; heads: {sorted(self.heads)}")
        if features.shape[-1] != self.dim:
            raise ValueError(f"{modality} features have dim {features.shape[-1]}, heads expect {self.dim}")
        return self.heads[modality](features)

    def parameter_names(self, modalities: Iterable[str]) -> list[str]:
        """Names (as in `named_parameters`) of the parameters of the given modalities' heads."""
        prefixes = tuple(f"heads.{m}." for m in modalities)
        return [name for name, _ in self.named_parameters() if name.startswith(prefixes)]

    def train_only(self, modalities: Iterable[str]) -> None:
        """Only the given heads require gradients (spec §2.1: only the current pair's learners move)."""
        keep = set(modalities)
        for name, head in self.heads.items():
            head.requires_grad_(name in keep)


def fold_into_clip(
    clip: CLIPModel, heads: LearnerHeads, image_modality: str, text_modality: str
) -> CLIPModel:
    """A plain `CLIPModel` whose projections carry the learner heads: `visual_projection ← W^image · P_v`,
    `text_projection ← W^text · P_t` (a copy; `clip` is left alone).

    The heads act on the normalised projected features z* = P x / ‖P x‖; CLIP scores cosines, and
    normalize(W (P x / ‖P x‖)) = normalize(W P x), so the folded CLIP's embeddings point exactly where the heads'
    outputs point. Only bias-free heads fold into CLIP's bias-free projections.
    """
    folded = copy.deepcopy(clip)
    for modality, projection_name in (
        (image_modality, "visual_projection"),
        (text_modality, "text_projection"),
    ):
        head = heads.heads[modality] if modality in heads.heads else None
        if head is None:
            raise KeyError(f"no learner head for modality {modality!r}; heads: {sorted(heads.heads)}")
        if head.bias is not None:
            raise ValueError(
                "heads with a bias cannot be folded into CLIP's bias-free projections (use bias=False)"
            )
        projection: nn.Linear = getattr(folded, projection_name)
        if projection.out_features != heads.dim:
            raise ValueError(
                f"{projection_name} has {projection.out_features} outputs, heads expect {heads.dim}"
            )
        with torch.no_grad():
            weight = head.weight.detach().to(projection.weight) @ projection.weight
            projection.weight.copy_(weight)
    return folded
