"""Per-modality learner heads on a frozen dual encoder, CMCL's trainable part (Liu et al. 2025; spec cmcl.md §2.1,
§2.6), as a submodule of `ContinualCLIPModel` (`model.learner_heads`).

Each modality m has a square linear learner W^m ∈ R^{d×d}, initialised to the identity (App. A.5), so step 0
reproduces the frozen prior exactly: z^m = W^m z*_m (Alg. 2, line 1), z*_m the frozen encoder's output (the
cached features of `hf_ccl.data.pair_features`). The pair loss is Eq. (2), CMCL's one-directional InfoNCE with the
pair's first modality as anchor,

    L = −(1/n) Σ_i log softmax_j(z^a_i · z^b_j / τ)_i,

on raw inner products of the learner outputs (`similarity="dot"`; the official code's τ = 1 on ImageBind features
with built-in scales, for CLIP features the frozen prior's 1/exp(logit_scale), spec A10). `symmetric=True` averages
both directions (CLIP's loss).

Saving folds the image and text heads into CLIP's projections (`folded_projections`), so every checkpoint is a
plain CLIP: normalize(W (P x / ‖P x‖)) = normalize(W P x), so the folded CLIP's embeddings point exactly where the
heads' outputs point.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

SIMILARITIES = ("dot", "cosine")


def check_objective(temperature: float, similarity: str) -> None:
    """τ > 0 and a known similarity."""
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {list(SIMILARITIES)}, got {similarity!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def pair_logits(z_a: torch.Tensor, z_b: torch.Tensor, temperature: float = 1.0, similarity: str = "dot") -> torch.Tensor:
    """[n_a, n_b] scores z^a_i · z^b_j / τ (`dot`, the paper) or cosines / τ (`cosine`, what a CLIP computes)."""
    check_objective(temperature, similarity)
    if similarity == "cosine":
        z_a, z_b = F.normalize(z_a, dim=-1), F.normalize(z_b, dim=-1)
    return z_a @ z_b.T / temperature


def pair_contrastive_loss(logits: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    """Eq. (2): cross-entropy of row i against column i (anchor = the pair's first modality); with `symmetric`,
    the mean of both directions."""
    if logits.ndim != 2 or logits.shape[0] != logits.shape[1] or logits.shape[0] == 0:
        raise ValueError(f"pair logits must be a non-empty square matrix, got shape {tuple(logits.shape)}")
    targets = torch.arange(logits.shape[0], device=logits.device)
    loss = F.cross_entropy(logits.float(), targets)
    if symmetric:
        loss = (loss + F.cross_entropy(logits.float().T, targets)) / 2
    return loss


@dataclass
class PairOutput(ModelOutput):
    """What a pair batch's forward returns: the pair loss (Eq. 2), the scores [n, n] and both learner outputs."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    z_a: torch.Tensor | None = None
    z_b: torch.Tensor | None = None


class LearnerHeads(nn.Module):
    """One identity-initialised `nn.Linear(dim, dim)` per modality name (spec §2.1: W^m_1 = I, bias off by default,
    A8), the pair objective (`temperature` τ, `similarity`, `symmetric`), the (image, text) modalities whose heads
    are folded into CLIP's projections when saved (`fold`; None: the saved CLIP is the frozen prior), and, for the
    drift diagnostic (Def. 1), the heads' weights right after each task (`snapshots`, task name -> state)."""

    def __init__(
        self,
        dim: int,
        modalities: Iterable[str] = (),
        *,
        bias: bool = False,
        temperature: float = 1.0,
        similarity: str = "dot",
        symmetric: bool = False,
        fold: tuple[str, str] | None = ("image", "en"),
    ):
        super().__init__()
        if dim < 1:
            raise ValueError(f"head dim must be >= 1, got {dim}")
        check_objective(temperature, similarity)
        self.dim, self.bias = dim, bias
        self.temperature, self.similarity, self.symmetric = temperature, similarity, symmetric
        if fold is not None and bias:
            raise ValueError("heads with a bias cannot be folded into CLIP's bias-free projections: fold=None")
        self.fold = fold
        self.heads = nn.ModuleDict()
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}
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
        return self._head(modality)

    def _head(self, modality: str) -> nn.Linear:
        head = self.heads[modality]
        assert isinstance(head, nn.Linear)  # only `ensure` adds heads
        return head

    def head_output(self, modality: str, features: torch.Tensor) -> torch.Tensor:
        """z^m = W^m z*_m (Alg. 2 l.1) for row features [n, dim]."""
        if modality not in self.heads:
            raise KeyError(f"no learner head for modality {modality!r}; heads: {sorted(self.heads)}")
        if features.shape[-1] != self.dim:
            raise ValueError(f"{modality} features have dim {features.shape[-1]}, heads expect {self.dim}")
        return self.heads[modality](features)

    def forward(
        self, modality_a: str, modality_b: str, features_a: torch.Tensor, features_b: torch.Tensor,
        return_loss: bool = True,
    ) -> PairOutput:
        """Both learner outputs of aligned rows `features_a[i] ↔ features_b[i]`, their scores and the pair loss."""
        z_a, z_b = self.head_output(modality_a, features_a), self.head_output(modality_b, features_b)
        logits = pair_logits(z_a, z_b, self.temperature, self.similarity)
        loss = pair_contrastive_loss(logits, self.symmetric) if return_loss else None
        return PairOutput(loss=loss, logits=logits, z_a=z_a, z_b=z_b)

    def train_only(self, modalities: Iterable[str]) -> None:
        """Only the given heads require gradients (spec §2.1: only the current pair's learners move)."""
        keep = set(modalities)
        for name, head in self.heads.items():
            head.requires_grad_(name in keep)

    def snapshot(self, task_name: str) -> None:
        """Keep the heads as they are now (after `task_name`), for the drift of its alignment matrix."""
        self.snapshots[task_name] = {name: p.detach().cpu().clone() for name, p in self.state_dict().items()}

    def folded_projections(
        self, visual_projection: torch.Tensor, text_projection: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`W^image · P_v` and `W^text · P_t` (the `fold` modalities): CLIP's projection weights with the heads in."""
        if self.fold is None:
            return visual_projection, text_projection
        folded = []
        for modality, projection in zip(self.fold, (visual_projection, text_projection), strict=True):
            if modality not in self.heads:
                raise KeyError(f"no learner head for modality {modality!r}; heads: {sorted(self.heads)}")
            if projection.shape[0] != self.dim:
                raise ValueError(f"a projection with {projection.shape[0]} outputs; the heads expect {self.dim}")
            folded.append(self._head(modality).weight.detach().to(projection) @ projection)
        return folded[0], folded[1]
