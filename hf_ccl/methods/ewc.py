"""EWC (Kirkpatrick et al., "Overcoming catastrophic forgetting in neural networks", PNAS 2017) in its online form
(Schwarz et al., "Progress & Compress", ICML 2018), with CLIP's contrastive loss as the task loss.

    L(θ) = L_contrastive(θ) + (λ/2) Σ_i F_i (θ_i − θ*_i)²                (Kirkpatrick et al. 2017, Eq. 3)
    F ← γ F + F_t,   θ* ← θ at the end of task t                       (online EWC, Schwarz et al. 2018)

F_t is the diagonal empirical Fisher of task t. It is estimated at the end of the task over the task's training
data (one pass by default), with the model in eval mode, as the mean over batches of the squared gradient of each
batch's contrastive loss (the class-prompt cross-entropy for a classification task trained with
`classification_loss: cross_entropy`: the Fisher of the loss the task trained with):

    F_t = (1/|B|) Σ_{b ∈ B} (∇_θ L_contrastive(b))².

The gradient is per *batch*, not per example: a contrastive loss has no per-example form, because a pair's
negatives are the rest of its batch. CLL-CLIP's oEWC code does the same ("the mean over all training batches
(bs 128) of the squared batch gradient", specs/cllclip.md §6), and so does CTP's EWC baseline (specs/ctp.md §4).
Each batch's loss uses that batch alone (no all-gather), so F_t does not depend on the number of processes; the
sums are reduced across processes.

Where this differs from the sources:
- The penalty uses F. Schwarz et al. write ‖θ − θ*‖²_{γF*}; the two agree at the default γ = 1.
- The CTP code merges Fisher matrices by a running mean (`accumulate="average"`); online EWC sums them
  (`accumulate="sum"`, the default).
- CTP estimates F in train mode with augmentation; here the model is in eval mode and the collator takes each
  example's first caption.
- CLL-CLIP's code writes λ Σ F (θ − θ*)² without the 1/2, so its λ = 1000 is `ewc_lambda=2000` here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .base import TaskContext
from .registry import register_method
from .regularization import (
    QuadraticPenaltyConfig,
    QuadraticPenaltyMethod,
    batch_task_loss,
    check_accumulation,
    mean_gradient_statistic,
    task_batches,
)


@dataclass
class EWCConfig(QuadraticPenaltyConfig):
    ewc_lambda: float = field(
        default=5000.0,
        metadata={
            "help": "λ in (λ/2) Σ F (θ − θ*)² (Kirkpatrick Eq. 3); 5000 is the CTP code's value (ctp.md §3)."
        },
    )
    gamma: float = field(
        default=1.0,
        metadata={
            "help": "Online-EWC decay in F ← γF + F_t (Schwarz et al. 2018); 1 = plain sum (CLL-CLIP's γ)."
        },
    )
    accumulate: str = field(
        default="sum",
        metadata={"help": "'sum': F ← γF + F_t (online EWC); 'average': running mean over tasks (CTP code)."},
    )
    fisher_batch_size: int = field(
        default=128,
        metadata={
            "help": "Examples per Fisher batch (the squared gradient is per batch); 128 as CLL-CLIP's code."
        },
    )
    fisher_max_batches: int | None = field(
        default=None,
        metadata={
            "help": "Batches in the Fisher pass (a seeded random subset); None: one pass over the task's data."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_accumulation(self.accumulate, self.gamma)
        if self.ewc_lambda < 0:
            raise ValueError(f"ewc_lambda must be >= 0, got {self.ewc_lambda}")
        if self.fisher_batch_size < 1:
            raise ValueError(f"fisher_batch_size must be >= 1, got {self.fisher_batch_size}")
        if self.fisher_max_batches is not None and self.fisher_max_batches < 1:
            raise ValueError(f"fisher_max_batches must be >= 1 or None, got {self.fisher_max_batches}")


@register_method
class EWC(QuadraticPenaltyMethod[EWCConfig]):
    """Online EWC: a Fisher-weighted pull towards the parameters at the end of the previous task."""

    fsdp_refusal = None  # the penalty over each process's shards (tests/test_fsdp.py)
    name = "ewc"
    test_families = ("siglip",)
    trains_pair_tasks = True  # on pair tasks: the trainable heads, with the pair loss (CMCL's baselines)
    config_class = EWCConfig

    @property
    def strength(self) -> float:
        return self.config.ewc_lambda / 2.0

    def on_task_end(self, context: TaskContext) -> None:
        """Estimate F_t over the task's data, merge it into F, anchor θ* at the current parameters."""
        model = context.model
        config = self.config
        batches = task_batches(context, self.name, config.fisher_batch_size, config.fisher_max_batches)
        loss = functools.partial(batch_task_loss, class_prompts=context.class_prompts)  # the loss the task trained
        fisher = mean_gradient_statistic(model, batches, self.covered_parameters(model), loss, statistic="square")
        self.consolidate(model, fisher, config.accumulate, config.gamma)
