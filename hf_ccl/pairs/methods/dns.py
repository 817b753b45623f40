"""DNS (Dual-sided Null Space; Liu et al., "Continual Multimodal Contrastive Learning", Sec. 3.2–3.3, Alg. 1) on
per-modality learner heads: the paper's own setting (spec cmcl.md §2.5).

For the current pair (a, b), each head's weight gradient G = ∇W^m is replaced, after clipping and before the
optimizer step, by (Thm. 4, Eq. 8; spec A1)

    ΔW^m = G − P_out[m] G P_in[m],

P_in[m] the range projector of the running uncentered covariance of m's OWN inputs z*_m (right side) and P_out[m]
that of the outputs of m's PARTNERS, W^{m'} z*_{m'}, over every earlier task m took part in (left side, A2). Both are
built at task start (Alg. 1 l.4–7) and fixed for the task. A modality never seen before trains unprojected (A15).

After each task, one pass over its training features updates (Alg. 1 l.16–18, Thm. 8; spec §2.5 pseudocode):

    C_in[a] += Xa,  C_in[b] += Xb,  C_out[a] += Yb,  C_out[b] += Ya,   Y = X Wᵀ (bias-free, final W_t; A17)

as running means C ← (n̄/(n̄+n)) C + Xᵀ X/(n̄+n), with per-modality counts (A5) or one global count
(`counts="global"`, the official code). The features are the cached task features, identical on every process,
so the covariances need no reduction.

Options: `variant="one_sided"` (P_out = I, ΔW = G (I − P_in)); `preset="official"` (the released code: output
threshold 0, which keeps numerically-zero eigenvalues so P_out ≈ I (A3), and global counts); `project="update"`
also projects the step the optimizer made (exact at first order under AdamW and weight decay, A7).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ...methods.base import MethodConfig
from ...methods.projection import (
    THRESHOLD_MODES,
    dual_null_space_projection,
    merge_second_moment,
    null_space_projector,
)
from ..heads import LearnerHeads
from .base import PairMethod, PairTaskContext, register_pair_method

logger = logging.getLogger(__name__)

VARIANTS = ("paper", "one_sided")
PROJECT_MODES = ("gradient", "update")
COUNT_RULES = ("per_modality", "global")
PRESETS = ("paper", "official")


@dataclass
class PairDNSConfig(MethodConfig):
    threshold_in: float = field(
        default=1e-4,
        metadata={
            "help": "λ_min of P_in (right side). Paper: 1e-4 for unit-norm LanguageBind features, 0.01 ImageBind."
        },
    )
    threshold_out: float = field(
        default=1e-4, metadata={"help": "λ_min of P_out (left side); the paper's single λ_min (A3)."}
    )
    threshold_mode: str = field(
        default="absolute",
        metadata={"help": "'absolute' (λ > λ_min, paper) or 'relative' (λ/λ_max > λ_min, A4)."},
    )
    variant: str = field(
        default="paper", metadata={"help": "'paper' (G − P_out G P_in) or 'one_sided' (G (I − P_in))."}
    )
    project: str = field(
        default="gradient",
        metadata={"help": "'gradient' (paper) or 'update' (also project the optimizer's step, A7)."},
    )
    counts: str = field(
        default="per_modality",
        metadata={"help": "Running-mean normaliser n̄: 'per_modality' (paper) or 'global' (code)."},
    )
    preset: str = field(
        default="paper",
        metadata={
            "help": "'official': the released code's behaviour (threshold_out=0, counts='global'; spec A3, A5)."
        },
    )

    def __post_init__(self) -> None:
        checks = (
            ("threshold_mode", THRESHOLD_MODES),
            ("variant", VARIANTS),
            ("project", PROJECT_MODES),
            ("counts", COUNT_RULES),
            ("preset", PRESETS),
        )
        for name, valid in checks:
            if getattr(self, name) not in valid:
                raise ValueError(f"dns {name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        for name in ("threshold_in", "threshold_out"):
            if getattr(self, name) < 0:
                raise ValueError(f"dns {name} must be >= 0, got {getattr(self, name)}")
        if self.preset == "official":
            self.threshold_out, self.counts = 0.0, "global"


@register_pair_method
class PairDNS(PairMethod):
    """Dual-sided null-space projection of the learner heads' gradients (Thm. 4, Eq. 8). See the module docstring."""

    name = "dns"
    config_class = PairDNSConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        #: Per modality: {"in": C_in [d, d], "out": C_out [d, d]} running means, float64 on the CPU.
        self.covariances: dict[str, dict[str, torch.Tensor]] = {}
        #: Per modality: rows behind each running mean ({"in": n̄, "out": n̄}).
        self.counts: dict[str, dict[str, int]] = {}
        self.global_count = 0
        self.projectors: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.ranks: dict[str, dict[str, int]] = {}
        self._before_step: dict[str, torch.Tensor] = {}
        self._removed: dict[str, float] = {}

    # ----- Alg. 1 l.4-7 -------------------------------------------------------------------------------------------
    def projector_pair(self, modality: str) -> tuple[torch.Tensor | None, torch.Tensor, int, int] | None:
        """(P_out or None for identity, P_in, rank_out, rank_in) of a seen modality, or None (no projection)."""
        stored, counts = self.covariances.get(modality), self.counts.get(modality, {})
        if stored is None or counts.get("in", 0) == 0:
            return None
        config = self.config
        p_in, rank_in = null_space_projector(stored["in"], config.threshold_in, config.threshold_mode)
        if config.variant == "one_sided":
            return (None, p_in, -1, rank_in) if rank_in else None
        if counts.get("out", 0) == 0:
            return None
        p_out, rank_out = null_space_projector(stored["out"], config.threshold_out, config.threshold_mode)
        return (p_out, p_in, rank_out, rank_in) if rank_in and rank_out else None

    def on_task_start(self, context: PairTaskContext) -> None:
        self.projectors, self.ranks, self._removed = {}, {}, {}
        device = next(context.heads.parameters()).device
        for modality in context.task.modalities:
            built = self.projector_pair(modality)
            if built is None:
                continue
            p_out, p_in, rank_out, rank_in = built
            move = {"device": device, "dtype": torch.float32}
            self.projectors[modality] = (None if p_out is None else p_out.to(**move), p_in.to(**move))
            self.ranks[modality] = {"in": rank_in, "out": rank_out}
            logger.info(
                "dns task %d: %s rank(P_in)=%d rank(P_out)=%s",
                context.task_index,
                modality,
                rank_in,
                "identity" if rank_out < 0 else rank_out,
            )

    # ----- Alg. 1 l.13 --------------------------------------------------------------------------------------------
    def _project(self, modality: str, matrix: torch.Tensor) -> torch.Tensor:
        p_out, p_in = self.projectors[modality]
        work = matrix.float()
        return dual_null_space_projection(work, p_out, p_in).to(matrix.dtype)

    def pre_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """weight.grad ← G − P_out G P_in for each projected head of the pair (the bias, if any, is not projected)."""
        self._before_step = {}
        with torch.no_grad():
            for modality in self.projectors:
                weight = heads.heads[modality].weight
                if self.config.project == "update":
                    self._before_step[modality] = weight.detach().clone()
                if weight.grad is None:
                    continue
                projected = self._project(modality, weight.grad)
                norm = weight.grad.float().norm()
                self._removed[modality] = (
                    float((weight.grad.float() - projected.float()).norm() / norm) if norm else 0.0
                )
                weight.grad.copy_(projected)

    def post_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """`project="update"`: W ← W_old + proj(W_new − W_old)."""
        with torch.no_grad():
            for modality, before in self._before_step.items():
                weight = heads.heads[modality].weight
                weight.copy_(before + self._project(modality, weight.detach() - before))
        self._before_step = {}

    def metrics(self) -> dict[str, float]:
        values = {"active": float(bool(self.projectors))}
        for modality, ranks in self.ranks.items():
            values[f"rank_in/{modality}"] = float(ranks["in"])
            values[f"rank_out/{modality}"] = float(ranks["out"])
        values.update({f"removed/{m}": v for m, v in self._removed.items()})
        return values

    # ----- Alg. 1 l.16-18 -----------------------------------------------------------------------------------------
    def on_task_end(self, context: PairTaskContext) -> None:
        """Fold the task's inputs and partner outputs into the running covariances."""
        heads, task = context.heads, context.task
        inputs = {task.modality_a: context.train_a, task.modality_b: context.train_b}
        with torch.no_grad():
            outputs = {
                m: x.double() @ heads.heads[m].weight.detach().double().cpu().T for m, x in inputs.items()
            }  # bias-free outputs with the final W_t (A17)
        partner = {task.modality_a: task.modality_b, task.modality_b: task.modality_a}
        rows = context.train_a.shape[0]
        for modality, x in inputs.items():
            stored = self.covariances.setdefault(modality, {})
            counts = self.counts.setdefault(modality, {"in": 0, "out": 0})
            y = outputs[partner[modality]]
            for key, gram in (("in", x.double().T @ x.double()), ("out", y.T @ y)):
                # per-modality n̄ (paper), or the official code's one counter over all modalities (A5)
                seen = self.global_count if self.config.counts == "global" else counts[key]
                stored[key], counts[key] = merge_second_moment(stored.get(key), seen, gram, rows)
        if self.config.counts == "global":
            self.global_count += rows
        self.projectors, self._before_step = {}, {}

    # ----- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "covariances": {m: dict(c) for m, c in self.covariances.items()},
            "counts": {m: dict(c) for m, c in self.counts.items()},
            "global_count": self.global_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.covariances = {
            m: {side: value.double().cpu() for side, value in c.items()}
            for m, c in state.get("covariances", {}).items()
        }
        self.counts = {m: {side: int(v) for side, v in c.items()} for m, c in state.get("counts", {}).items()}
        self.global_count = int(state.get("global_count", 0))
        self.projectors, self.ranks = {}, {}
