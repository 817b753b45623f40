"""MAS (Aljundi et al., "Memory Aware Synapses: Learning what (not) to forget", ECCV 2018) on CLIP's embeddings.

    Ω_t = (1/N) Σ_k |g(x_k)|,   g(x_k) = ∂ ℓ2²(F(x_k; θ)) / ∂θ        (Aljundi et al. 2018, §4.1, Eq. 2 and 4)
    L(θ) = L_contrastive(θ) + λ Σ_i Ω_i (θ_i − θ*_i)²                 (Aljundi et al. 2018, Eq. 3)
    Ω ← Ω + Ω_t,   θ* ← θ at the end of task t     (summed over tasks, as the paper's code does)

The "output" F(x) of a CLIP pair is its two unnormalised projected embeddings, image v and text w, so
ℓ2²(F(x_k)) = ‖v_k‖² + ‖w_k‖². The image term moves only the vision tower and its projection, the text term only
the text tower and its projection, and `logit_scale` gets importance 0.

The gradient is taken per example by default (`per_example=True`, the paper's estimator, one backward pass per
example). `per_example=False` takes |∇ of the batch mean| instead: cheaper, and the approximation that batch-wise
MAS implementations compute. The pass runs over the task's training data at task end, in eval mode; sums and
counts are reduced across processes.

Where this differs from CTP's re-implementation (specs/ctp.md §4): CTP sums the unsquared norms and adds the
fusion CLS (CLIP has none); it writes the penalty as (λ/2) Σ Ω Δθ² (to match, set `mas_lambda` to half its λ);
and it merges tasks by a running mean (`accumulate="average"` here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import TaskContext
from .registry import register_method
from .regularization import (
    QuadraticPenaltyConfig,
    QuadraticPenaltyMethod,
    check_accumulation,
    mean_gradient_statistic,
    squared_embedding_norms,
    task_batches,
)


@dataclass
class MASConfig(QuadraticPenaltyConfig):
    mas_lambda: float = field(
        default=1.0, metadata={"help": "λ in λ Σ Ω (θ − θ*)² (Aljundi Eq. 3); 1 as the paper and CTP's code."}
    )
    accumulate: str = field(
        default="sum",
        metadata={"help": "'sum': Ω ← Ω + Ω_t (MAS); 'average': running mean over tasks (CTP code)."},
    )
    per_example: bool = field(
        default=True,
        metadata={
            "help": "Per-example |gradient| (the paper's Eq. 2); False: |gradient of the batch mean| (faster)."
        },
    )
    importance_batch_size: int = field(
        default=32, metadata={"help": "Examples collated at a time in the pass."}
    )
    importance_max_batches: int | None = field(
        default=None,
        metadata={
            "help": "Batches in the importance pass (a seeded random subset); None: the task's whole data."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_accumulation(self.accumulate)
        if self.mas_lambda < 0:
            raise ValueError(f"mas_lambda must be >= 0, got {self.mas_lambda}")
        if self.importance_batch_size < 1:
            raise ValueError(f"importance_batch_size must be >= 1, got {self.importance_batch_size}")
        if self.importance_max_batches is not None and self.importance_max_batches < 1:
            raise ValueError(
                f"importance_max_batches must be >= 1 or None, got {self.importance_max_batches}"
            )


@register_method
class MAS(QuadraticPenaltyMethod[MASConfig]):
    """Memory Aware Synapses: importance = sensitivity of the embeddings' squared norm to each parameter."""

    fsdp_refusal = None  # the penalty over each process's shards (tests/test_fsdp.py)
    name = "mas"
    test_options = {"importance_batch_size": 8, "importance_max_batches": 1}  # the importance pass (a backward pass per example) on 8 examples
    same_step_as = "ewc"
    trains_pair_tasks = True  # on pair tasks: the trainable heads, with the pair loss (CMCL's baselines)
    config_class = MASConfig

    @property
    def strength(self) -> float:
        return self.config.mas_lambda

    def on_task_end(self, context: TaskContext) -> None:
        """Estimate Ω_t over the task's data, add it to Ω, anchor θ* at the current parameters."""
        model = context.model
        config = self.config
        batches = task_batches(
            context, self.name, config.importance_batch_size, config.importance_max_batches, drop_last=False
        )
        importance = mean_gradient_statistic(
            model,
            batches,
            self.covered_parameters(model),
            squared_embedding_norms,
            statistic="abs",
            per_example=config.per_example,
        )
        self.consolidate(model, importance, config.accumulate, gamma=1.0)
