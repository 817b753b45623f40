"""EWC on modality-pair streams (Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks",
PNAS 2017), online form (Schwarz et al., "Progress & Compress", ICML 2018); CMCL's baseline (spec cmcl.md §4, λ = 0.5):

    L(θ) = L_pair(θ) + (λ/2) Σ_i F_i (θ_i − θ*_i)²                               (Kirkpatrick et al. 2017, Eq. 3)
    F ← γ F + F_t,   θ* ← θ at the end of task t                              (online EWC, Schwarz et al. 2018)

F_t is the diagonal empirical Fisher of the current pair's heads, estimated at task end over the task's cached
training features as the mean over batches (`fisher_batch_size`) of the squared gradient of each batch's pair loss
(Eq. 2 of CMCL): a contrastive loss has no per-example form (a pair's negatives are its batch), as in the CLIP EWC
(`hf_ccl.methods.ewc`). Batches are planned identically on every process and dealt round-robin; sums and counts
are reduced (`regularization.mean_gradient_statistic`), so F_t does not depend on the number of processes.

Only the heads of the task's pair are updated: their F and θ* are merged and re-anchored; every other head keeps its
importance and anchor unchanged (it did not train, so γ does not decay it either). `accumulate="average"` is the
running mean over the tasks that trained that head. The penalty covers every head with an importance (the frozen
ones contribute a constant).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...distributed import rank, world_size
from ...methods.base import MethodConfig
from ...methods.regularization import (
    PENALTY_TERM,
    QuadraticPenalty,
    accumulate_importance,
    check_accumulation,
    mean_gradient_statistic,
    plan_batches,
)
from .base import PairMethod, PairTaskContext, register_pair_method

if TYPE_CHECKING:
    from ..heads import LearnerHeads


@dataclass
class PairEWCConfig(MethodConfig):
    ewc_lambda: float = field(
        default=0.5,
        metadata={"help": "λ in (λ/2) Σ F (θ − θ*)² (Kirkpatrick Eq. 3); 0.5 as CMCL's baseline (§4)."},
    )
    gamma: float = field(
        default=1.0,
        metadata={
            "help": "Online-EWC decay in F ← γF + F_t of the trained heads (Schwarz et al. 2018); 1 = sum."
        },
    )
    accumulate: str = field(
        default="sum",
        metadata={
            "help": "'sum': F ← γF + F_t; 'average': running mean over the tasks that trained the head."
        },
    )
    fisher_batch_size: int = field(
        default=64, metadata={"help": "Pairs per Fisher batch (the squared gradient is per batch)."}
    )
    fisher_max_batches: int | None = field(
        default=None,
        metadata={
            "help": "Batches in the Fisher pass (a seeded random subset); None: one pass over the task's pairs."
        },
    )

    def __post_init__(self) -> None:
        check_accumulation(self.accumulate, self.gamma)
        if self.ewc_lambda < 0:
            raise ValueError(f"ewc_lambda must be >= 0, got {self.ewc_lambda}")
        if self.fisher_batch_size < 1:
            raise ValueError(f"fisher_batch_size must be >= 1, got {self.fisher_batch_size}")
        if self.fisher_max_batches is not None and self.fisher_max_batches < 1:
            raise ValueError(f"fisher_max_batches must be >= 1 or None, got {self.fisher_max_batches}")


@contextmanager
def requiring_grad(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Temporarily make `params` require gradients (restored after)."""
    params = list(params)
    before = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, flag in zip(params, before, strict=True):
            p.requires_grad_(flag)


@register_pair_method
class PairEWC(PairMethod):
    """Online EWC on the learner heads: a Fisher-weighted pull towards each head's weights after its last task."""

    name = "ewc"
    config_class = PairEWCConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.penalty = QuadraticPenalty(sparse_token_rows=False)
        self.head_tasks: dict[str, int] = {}  # per modality: tasks that updated its importance

    @property
    def strength(self) -> float:
        return self.config.ewc_lambda / 2.0

    def loss_terms(
        self, heads: LearnerHeads, batch: Mapping[str, torch.Tensor], context: PairTaskContext
    ) -> dict[str, torch.Tensor]:
        """`penalty`: (λ/2) Σ F (θ − θ*)² over every head with an importance; an exact 0 before the first task end."""
        value = self.penalty.value(heads)
        if value is None:
            return {PENALTY_TERM: next(heads.parameters()).new_zeros((), dtype=torch.float32)}
        return {PENALTY_TERM: self.strength * value}

    def fisher(self, context: PairTaskContext) -> dict[str, torch.Tensor]:
        """F_t of the current pair's head parameters: mean over batches of (∇ L_pair(batch))²."""
        config = self.config
        params = context.trainable_parameters()
        reference = next(iter(params.values()))
        plan = plan_batches(
            len(context.train_a), config.fisher_batch_size, config.fisher_max_batches, context.seed
        )
        modality_a, modality_b = context.task.modalities

        def batches() -> Iterator[dict[str, torch.Tensor]]:
            for indices in plan[rank() :: world_size()]:
                rows = torch.as_tensor(indices, dtype=torch.int64)
                yield {
                    "a": context.train_a[rows].to(reference.device, reference.dtype),
                    "b": context.train_b[rows].to(reference.device, reference.dtype),
                }

        def loss(heads: LearnerHeads, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return context.objective(heads, modality_a, modality_b, batch["a"], batch["b"])

        with requiring_grad(params.values()), torch.enable_grad():
            return mean_gradient_statistic(context.heads, batches(), params, loss, statistic="square")

    def on_task_end(self, context: PairTaskContext) -> None:
        """Estimate F_t on the task's pairs, merge it into the trained heads' F and re-anchor them."""
        self.consolidate(context.heads, self.fisher(context), context.task.modalities)

    def consolidate(
        self, heads: LearnerHeads, fisher: Mapping[str, torch.Tensor], modalities: Sequence[str]
    ) -> None:
        """Merge F_t into the importance of `modalities`' parameters and anchor them at their current values; the
        other heads' importances and anchors stay as they are."""
        config = self.config
        old_importance, old_anchor = self.penalty.importance, self.penalty.anchor
        merged = dict(old_importance)
        for modality in modalities:
            names = heads.parameter_names([modality])
            new = {name: fisher[name] for name in names if name in fisher}
            if not new:
                continue
            old = {name: old_importance[name] for name in names if name in old_importance}
            merged.update(
                accumulate_importance(
                    old, new, config.accumulate, config.gamma, self.head_tasks.get(modality, 0)
                )
            )
            self.head_tasks[modality] = self.head_tasks.get(modality, 0) + 1
        current = dict(heads.named_parameters())
        anchors = {
            name: old_anchor[name] if name in old_anchor and name not in fisher else current[name]
            for name in merged
        }
        self.penalty.set(merged, anchors)

    def state_dict(self) -> dict[str, Any]:
        return {"penalty": self.penalty.state_dict(), "head_tasks": dict(self.head_tasks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.penalty.load_state_dict(state.get("penalty", {}))
        self.head_tasks = {str(k): int(v) for k, v in dict(state.get("head_tasks", {})).items()}
