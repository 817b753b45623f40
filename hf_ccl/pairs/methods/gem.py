"""GEM and A-GEM on modality-pair streams: gradient constraints from an episodic memory of old pairs (spec cmcl.md §4).

GEM (Lopez-Paz & Ranzato, "Gradient Episodic Memory for Continual Learning", NeurIPS 2017). With g the current
gradient and g_k the gradient of task k's loss on its memory, the step uses the closest gradient that does not
increase any old loss (Eq. 10):

    min_g̃ ½‖g − g̃‖²   s.t. ⟨g̃, g_k⟩ ≥ 0 for all k < t,                                         (Eqs. 10–11)

solved through its dual, G = [g_1; …; g_{t−1}] (rows):

    min_v ½ vᵀ G Gᵀ v + (G g)ᵀ v   s.t. v ≥ 0,     g̃ = Gᵀ v* + g.                            (Eqs. 12–13)

As the official code (`project2cone2`, github.com/facebookresearch/GradientEpisodicMemory) this solves
min_v ½ vᵀ(G Gᵀ + εI)v + (G g)ᵀ v s.t. v ≥ γ, γ = `memory_strength` (the paper's "small constant added to v*"
biasing towards backward transfer; CMCL's margin 0.5) and ε = `qp_eps`, and projects only when some ⟨g, g_k⟩ < 0.
Then G g̃ = r − εv with r = (GGᵀ + εI)v + Gg ≥ 0 the QP's KKT multipliers, so ⟨g̃, g_k⟩ ≥ −ε v_k: the constraints
hold up to ε v_k (exactly with ε → 0). No quadprog: `solve_box_qp` is an exact active-set solver in float64.
The QP and both projections live in `hf_ccl.methods.gem_projection` (shared with the full-CLIP `gem` and `agem`).

A-GEM (Chaudhry et al., "Efficient Lifelong Learning with A-GEM", ICLR 2019) keeps a single constraint, on the
gradient g_ref of a random memory batch (`reference_batch_size` pairs drawn uniformly over all memories, seeded by
the global step):

    g̃ = g − (gᵀ g_ref / g_refᵀ g_ref) g_ref   if gᵀ g_ref < 0, else g.                          (Eq. 11)

Pair setting: the memory of task k holds `memory_per_task` of its training pairs (a seeded random subset, taken at
task end) with its modality pair; its loss is the pair objective (Eq. 2 of CMCL) on its own heads. Gradients are
taken w.r.t. the current pair's heads only (the others are frozen), so a task that shares no head with the current
pair has g_k = 0 and is skipped. A memory batch mixing tasks has the loss Σ_k (n_k / n) L_k (the size-weighted mean
of the per-task pair losses: different tasks use different heads, and negatives come from the same task).
Memory gradients use `torch.autograd.grad` (`p.grad` is untouched until the projected g̃ is written back), in the
parameters' dtype and device; every process holds the same memory and the same (averaged) gradient, so every
process projects identically without communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...methods.base import MethodConfig
from ...methods.gem_projection import agem_project, flat_grad, gem_project, write_flat_grad
from .base import PairMethod, PairTaskContext, register_pair_method

if TYPE_CHECKING:
    from ..heads import LearnerHeads
    from ..objective import PairObjective


# ----- memories ---------------------------------------------------------------------------------------------------
@dataclass
class PairMemory:
    """Task `task_index`'s stored pairs: rows of `a` (for `modality_a`) and `b` (for `modality_b`), CPU float32."""

    task_index: int
    task_name: str
    modality_a: str
    modality_b: str
    a: torch.Tensor
    b: torch.Tensor
    _cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __len__(self) -> int:
        return len(self.a)

    @property
    def modalities(self) -> tuple[str, str]:
        return self.modality_a, self.modality_b

    def on(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both sides on `like`'s device and dtype (copied once, then cached)."""
        key = (like.device, like.dtype)
        if key not in self._cache:
            self._cache.clear()
            self._cache[key] = (self.a.to(like.device, like.dtype), self.b.to(like.device, like.dtype))
        return self._cache[key]


def shares_head(modalities: Sequence[str], current: Sequence[str]) -> bool:
    """Whether a pair has a head among the current (trainable) pair's."""
    return bool(set(modalities) & set(current))


def grouped_pair_loss(
    heads: LearnerHeads,
    objective: PairObjective,
    groups: Sequence[tuple[PairMemory, torch.Tensor]],
    total: int,
    like: torch.Tensor,
) -> torch.Tensor | None:
    """Σ_k (n_k / total) L_k over (memory, rows) groups: the loss of a memory batch that mixes tasks; None when no
    group was given."""
    loss = None
    for memory, rows in groups:
        a, b = memory.on(like)
        rows = rows.to(a.device)
        term = objective(heads, memory.modality_a, memory.modality_b, a[rows], b[rows]) * (len(rows) / total)
        loss = term if loss is None else loss + term
    return loss


@dataclass
class EpisodicMemoryConfig(MethodConfig):
    memory_per_task: int = field(
        default=256,
        metadata={
            "help": "Pairs stored per task (a seeded random subset of its training pairs); 256 is CMCL's buffer "
            "size (App. E, which does not say whether GEM's is per task)."
        },
    )
    seed: int = field(
        default=0, metadata={"help": "Memory seed, combined with the run's seed and the task index."}
    )

    def __post_init__(self) -> None:
        if self.memory_per_task < 1:
            raise ValueError(f"memory_per_task must be >= 1, got {self.memory_per_task}")


@dataclass
class GEMConfig(EpisodicMemoryConfig):
    memory_strength: float = field(
        default=0.5,
        metadata={
            "help": "γ in v ≥ γ on GEM's dual variables (official `memory_strength`); CMCL's margin 0.5."
        },
    )
    qp_eps: float = field(
        default=1e-3,
        metadata={"help": "ε added to the diagonal of GGᵀ (official project2cone2); must be > 0."},
    )
    qp_tol: float = field(default=1e-10, metadata={"help": "Relative KKT tolerance of the QP solver."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.memory_strength < 0:
            raise ValueError(f"memory_strength must be >= 0, got {self.memory_strength}")
        if self.qp_eps <= 0:
            raise ValueError(
                f"qp_eps must be > 0 (GGᵀ is singular with more tasks than parameters), got {self.qp_eps}"
            )
        if self.qp_tol <= 0:
            raise ValueError(f"qp_tol must be > 0, got {self.qp_tol}")


@dataclass
class AGEMConfig(EpisodicMemoryConfig):
    reference_batch_size: int = field(
        default=256,
        metadata={
            "help": "Memory pairs in g_ref's batch, drawn uniformly over all memories each step (A-GEM)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reference_batch_size < 1:
            raise ValueError(f"reference_batch_size must be >= 1, got {self.reference_batch_size}")


class EpisodicMemoryMethod(PairMethod):
    """Base of GEM and A-GEM: one memory per finished task, saved in the method state."""

    config_class = EpisodicMemoryConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.memories: list[PairMemory] = []
        self._metrics: dict[str, float] = {}

    def on_task_end(self, context: PairTaskContext) -> None:
        """Store `memory_per_task` of the task's training pairs (seeded) with its modality pair."""
        n = len(context.train_a)
        if len(context.train_b) != n or n == 0:
            raise ValueError(
                f"task {context.task.name!r}: train_a and train_b must hold the same, non-zero, rows"
            )
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index])
        rows = torch.as_tensor(np.sort(rng.permutation(n)[: self.config.memory_per_task]), dtype=torch.int64)
        memory = PairMemory(
            context.task_index,
            context.task.name,
            context.task.modality_a,
            context.task.modality_b,
            context.train_a[rows].detach().to("cpu", torch.float32).clone(),
            context.train_b[rows].detach().to("cpu", torch.float32).clone(),
        )
        self.memories = [m for m in self.memories if m.task_index != context.task_index] + [memory]
        self.memories.sort(key=lambda m: m.task_index)

    def past_memories(self, context: PairTaskContext) -> list[PairMemory]:
        """Memories of the tasks before the current one."""
        return [m for m in self.memories if m.task_index < context.task_index]

    @staticmethod
    def trainable(heads: LearnerHeads, context: PairTaskContext) -> list[torch.nn.Parameter]:
        """The current pair's parameters of `heads` (the module the hook received) that require gradients."""
        names = set(heads.parameter_names(context.task.modalities))
        return [p for name, p in heads.named_parameters() if name in names and p.requires_grad]

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "task_index": [m.task_index for m in self.memories],
            "task_name": [m.task_name for m in self.memories],
            "modality_a": [m.modality_a for m in self.memories],
            "modality_b": [m.modality_b for m in self.memories],
            "a": [m.a for m in self.memories],
            "b": [m.b for m in self.memories],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        columns = [
            list(state.get(k, [])) for k in ("task_index", "task_name", "modality_a", "modality_b", "a", "b")
        ]
        if len({len(column) for column in columns}) != 1:
            raise ValueError(
                f"{self.name} state: memory fields of different lengths {[len(c) for c in columns]}"
            )
        self.memories = [
            PairMemory(
                int(t),
                str(name),
                str(ma),
                str(mb),
                torch.as_tensor(a).float().clone(),
                torch.as_tensor(b).float().clone(),
            )
            for t, name, ma, mb, a, b in zip(*columns, strict=True)
        ]
        self.memories.sort(key=lambda m: m.task_index)
        self._metrics = {}


@register_pair_method
class GEM(EpisodicMemoryMethod):
    """GEM: project the gradient so that no old task's memory loss increases (Eqs. 10–13; module docstring).

    Metrics of the last step: `constraints` (past tasks sharing a head), `violations` (those with ⟨g, g_k⟩ < 0),
    `projected` (1 when g was replaced; its mean over a logging window is the projected fraction), `grad_change`
    (‖g̃ − g‖ / ‖g‖) and `dual_max` (max v*)."""

    name = "gem"
    config_class = GEMConfig

    def memory_gradients(
        self, heads: LearnerHeads, context: PairTaskContext, params: Sequence[torch.Tensor]
    ) -> tuple[list[PairMemory], torch.Tensor | None]:
        """The past tasks sharing a head with the current pair, and their memory-loss gradients G [k, P] w.r.t.
        `params` (in the parameters' dtype and device; `p.grad` untouched)."""
        memories = [
            m for m in self.past_memories(context) if shares_head(m.modalities, context.task.modalities)
        ]
        rows = []
        for memory in memories:
            a, b = memory.on(params[0])
            with torch.enable_grad():
                loss = context.objective(heads, memory.modality_a, memory.modality_b, a, b)
                grads = torch.autograd.grad(loss, list(params), materialize_grads=True)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        return memories, (torch.stack(rows) if rows else None)

    def pre_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """Replace g by GEM's projection when some ⟨g, g_k⟩ < 0."""
        params = self.trainable(heads, context)
        self._metrics = {
            "constraints": 0.0,
            "violations": 0.0,
            "projected": 0.0,
            "grad_change": 0.0,
            "dual_max": 0.0,
        }
        if not params:
            return
        memories, G = self.memory_gradients(heads, context, params)
        if G is None:
            return
        g = flat_grad(params)
        dots = G.double() @ g.double()
        violations = int((dots < 0).sum())
        self._metrics.update(constraints=float(len(memories)), violations=float(violations))
        if violations == 0:
            return
        config = self.config
        projected, v = gem_project(g, G, config.memory_strength, config.qp_eps, config.qp_tol)
        write_flat_grad(params, projected)
        norm = float(g.double().norm())
        self._metrics.update(
            projected=1.0,
            grad_change=float((projected.double() - g.double()).norm()) / norm if norm > 0 else 0.0,
            dual_max=float(v.max()),
        )


@register_pair_method
class AGEM(EpisodicMemoryMethod):
    """A-GEM: one constraint, on the gradient of a random memory batch (Eq. 11; module docstring).

    Metrics of the last step: `projected` (1 when gᵀg_ref < 0), `grad_change` (‖g̃ − g‖ / ‖g‖) and `ref_cosine`
    (cos(g, g_ref); 0 without a reference gradient)."""

    name = "agem"
    config_class = AGEMConfig

    def reference_batch(self, context: PairTaskContext) -> tuple[list[tuple[PairMemory, torch.Tensor]], int]:
        """This step's memory batch, seeded by (seed, run seed, task, global step), drawn uniformly without
        replacement over every past memory: (memory, rows) per task, and the batch size."""
        memories = self.past_memories(context)
        sizes = [len(m) for m in memories]
        total = sum(sizes)
        if total == 0:
            return [], 0
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index, context.global_step])
        picks = np.sort(rng.choice(total, size=min(total, self.config.reference_batch_size), replace=False))
        bounds = np.cumsum([0, *sizes])
        groups = []
        for k, memory in enumerate(memories):
            rows = picks[(picks >= bounds[k]) & (picks < bounds[k + 1])] - bounds[k]
            if len(rows):
                groups.append((memory, torch.as_tensor(rows, dtype=torch.int64)))
        return groups, len(picks)

    def reference_gradient(
        self, heads: LearnerHeads, context: PairTaskContext, params: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """g_ref: the gradient of the memory batch's loss Σ_k (n_k/n) L_k w.r.t. `params`; None when no sampled task
        shares a head with the current pair (g_ref = 0)."""
        groups, total = self.reference_batch(context)
        groups = [(m, rows) for m, rows in groups if shares_head(m.modalities, context.task.modalities)]
        if not groups:
            return None
        with torch.enable_grad():
            loss = grouped_pair_loss(heads, context.objective, groups, total, params[0])
            grads = torch.autograd.grad(loss, list(params), materialize_grads=True)
        return torch.cat([g.reshape(-1) for g in grads])

    def pre_optimizer_step(self, heads: LearnerHeads, context: PairTaskContext) -> None:
        """Replace g by g − (gᵀg_ref / g_refᵀg_ref) g_ref when gᵀg_ref < 0."""
        params = self.trainable(heads, context)
        self._metrics = {"projected": 0.0, "grad_change": 0.0, "ref_cosine": 0.0}
        if not params:
            return
        g_ref = self.reference_gradient(heads, context, params)
        if g_ref is None:
            return
        g = flat_grad(params)
        projected, changed = agem_project(g, g_ref)
        g_norm, ref_norm = float(g.double().norm()), float(g_ref.double().norm())
        if g_norm > 0 and ref_norm > 0:
            self._metrics["ref_cosine"] = float(torch.dot(g.double(), g_ref.double())) / (g_norm * ref_norm)
        if not changed:
            return
        write_flat_grad(params, projected)
        self._metrics.update(
            projected=1.0,
            grad_change=float((projected.double() - g.double()).norm()) / g_norm if g_norm else 0.0,
        )
