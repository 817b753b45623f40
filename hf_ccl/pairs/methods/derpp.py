"""DER and DER++ on modality-pair streams (Buzzega et al., "Dark Experience for General Continual Learning: a Strong,
Simple Baseline", NeurIPS 2020; CMCL's adaptation, spec cmcl.md §4):

    L_DER   = L_pair + α E_{(x, z) ∈ M} ‖z − h_θ(x)‖²                                   (Buzzega et al., Eq. 4)
    L_DER++ = L_DER + β E_{(x'', y'') ∈ M} ℓ(y'', f_θ(x''))                            (Buzzega et al., Eq. 6)

The "logits" of a pair are CMCL's pair scores (spec §4): for a group of buffered pairs of one task, the matrix
S_ij = s(W^a x^a_i, W^b x^b_j) / τ of `PairObjective.logits`. The buffer keeps each pair's features (x^a, x^b),
its task and the learner outputs (z^a, z^b) recorded when the pair entered the buffer; the stored logits are
recomputed from the stored outputs with the objective's temperature and similarity. DER++'s "label" is the binary
same-instance label (App. A.4): ℓ is the pair objective (contrastive CE, Eq. 2) on the group.

Buffer: a reservoir (Algorithm R, `hf_ccl.data.buffer.ReservoirBuffer`) of `buffer_size` pairs over the whole
stream, updated at the end of each task with every training pair of the task in a seeded order; the new slots'
outputs are recorded then, with the heads just trained (Buzzega et al. record them at insertion; with a task-end
reservoir the task-end heads are the heads of insertion time).

Each step draws `replay_batch_size` slots uniformly without replacement (seeded by the global step) and groups them
by task (one modality pair and one recording time per group; negatives come from the same task). Over the groups the
terms are size-weighted means, n_g / n, of the per-group terms:

    der = α Σ_g (n_g / n) mean_ij (S^g_ij − S*^g_ij)²,      ce = β Σ_g (n_g / n) L_pair(group g).

Only the current pair's heads receive gradients (the others are frozen); groups of a task that shares no head with
the current pair add a constant. Both terms are 0 while the buffer is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...data.buffer import ReservoirBuffer
from ...methods.base import MethodConfig
from ..heads import pair_contrastive_loss, pair_logits
from .base import PairMethod, PairTaskContext, register_pair_method

if TYPE_CHECKING:
    from ..heads import LearnerHeads

BUFFER_FIELDS = ("a", "b", "z_a", "z_b")


@dataclass
class PairDERConfig(MethodConfig):
    buffer_size: int = field(
        default=256,
        metadata={"help": "Reservoir budget in pairs over the whole stream; 256 as CMCL (App. E)."},
    )
    replay_batch_size: int = field(
        default=64, metadata={"help": "Buffer pairs drawn per training step (seeded by the global step)."}
    )
    alpha: float = field(
        default=0.1,
        metadata={"help": "α, weight of the MSE to the stored pair logits (Eq. 4); 0.1 as CMCL (§4)."},
    )
    seed: int = field(
        default=0, metadata={"help": "Buffer seed, combined with the run's seed and the task index."}
    )

    def __post_init__(self) -> None:
        if self.buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {self.buffer_size}")
        if self.replay_batch_size < 1:
            raise ValueError(f"replay_batch_size must be >= 1, got {self.replay_batch_size}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")


@dataclass
class PairDERPPConfig(PairDERConfig):
    beta: float = field(
        default=0.1,
        metadata={
            "help": "β, weight of the contrastive CE on buffer pairs (Eq. 6); CMCL: 0.1 for LanguageBind, 0.001 for "
            "ImageBind/UniBind."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")


@register_pair_method
class PairDER(PairMethod):
    """DER: α × MSE between buffered pairs' current and stored pair logits (module docstring)."""

    name = "der"
    config_class = PairDERConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.buffer = ReservoirBuffer(self.config.buffer_size, seed=self.config.seed)
        self.tensors: dict[str, torch.Tensor] = {}  # BUFFER_FIELDS, [len(buffer), d] each, CPU float32
        self.pairs: dict[int, tuple[str, str, str]] = {}  # task index -> (task name, modality_a, modality_b)
        self._metrics: dict[str, float] = {}
        # (task, global step) of the last draw, and the draws made at it
        self._calls: tuple[tuple[int, int], int] = ((-1, -1), 0)

    def term_names(self) -> tuple[str, ...]:
        return ("der",)

    # ----- buffer -----------------------------------------------------------------------------------------------
    def on_task_end(self, context: PairTaskContext) -> None:
        """Reservoir update with every training pair of the task; record the new slots' learner outputs."""
        n = len(context.train_a)
        if len(context.train_b) != n:
            raise ValueError(
                f"task {context.task.name!r}: train_a has {n} rows, train_b {len(context.train_b)}"
            )
        changed = self.buffer.add_task(context.task_index, n, seed=context.seed)
        self.pairs[context.task_index] = (context.task.name, context.task.modality_a, context.task.modality_b)
        if not changed:
            return
        refs = self.buffer.refs
        rows = torch.as_tensor([refs[slot][1] for slot in changed], dtype=torch.int64)
        a = context.train_a[rows].detach().to("cpu", torch.float32)
        b = context.train_b[rows].detach().to("cpu", torch.float32)
        heads = context.heads
        reference = next(heads.parameters())
        with torch.no_grad():
            z_a = heads(context.task.modality_a, a.to(reference.device, reference.dtype)).float().cpu()
            z_b = heads(context.task.modality_b, b.to(reference.device, reference.dtype)).float().cpu()
        slots = torch.as_tensor(changed, dtype=torch.int64)
        for name, values in zip(BUFFER_FIELDS, (a, b, z_a, z_b), strict=True):
            stored = self.tensors.get(name)
            if stored is None:
                stored = values.new_zeros(len(self.buffer), values.shape[1])
            elif len(stored) < len(self.buffer):
                stored = torch.cat(
                    [stored, stored.new_zeros(len(self.buffer) - len(stored), stored.shape[1])]
                )
            stored[slots] = values
            self.tensors[name] = stored

    def slot_tasks(self) -> torch.Tensor:
        """The task index of every slot."""
        return torch.as_tensor([task for task, _ in self.buffer.refs], dtype=torch.int64)

    def sample(self, context: PairTaskContext) -> list[tuple[int, torch.Tensor]]:
        """This call's slots, `replay_batch_size` drawn uniformly without replacement, as (task index, slots)
        groups in task order. Seeded by (seed, run seed, task, global step, k), k counting the calls made at the
        same global step (micro-batches of gradient accumulation, or a trainer that updates the step late)."""
        size = len(self.buffer)
        if size == 0:
            return []
        key = (context.task_index, context.global_step)
        self._calls = (key, self._calls[1] + 1 if self._calls[0] == key else 0)
        rng = np.random.default_rng(
            [self.config.seed, context.seed, context.task_index, context.global_step, self._calls[1]]
        )
        slots = torch.as_tensor(
            np.sort(rng.choice(size, size=min(size, self.config.replay_batch_size), replace=False))
        )
        tasks = self.slot_tasks()[slots]
        return [(int(task), slots[tasks == task]) for task in torch.unique(tasks).tolist()]

    # ----- loss -------------------------------------------------------------------------------------------------
    def loss_terms(
        self, heads: LearnerHeads, batch: Mapping[str, torch.Tensor], context: PairTaskContext
    ) -> dict[str, torch.Tensor]:
        """`der` (and `ce` for DER++), already weighted; zeros while the buffer is empty."""
        reference = next(heads.parameters())
        groups = self.sample(context)
        if not groups:
            zero = torch.zeros((), dtype=torch.float32, device=reference.device)
            self._metrics = {"buffer": 0.0, "replay_groups": 0.0}
            return {name: zero for name in self.term_names()}
        objective = context.objective
        total = sum(len(slots) for _, slots in groups)
        mse = ce = None
        for task, slots in groups:
            _, modality_a, modality_b = self.pairs[task]
            a, b, z_a, z_b = (self.tensors[name][slots].to(reference.device) for name in BUFFER_FIELDS)
            current = objective.logits(
                heads, modality_a, modality_b, a.to(reference.dtype), b.to(reference.dtype)
            )
            stored = pair_logits(z_a, z_b, objective.temperature, objective.similarity)
            weight = len(slots) / total
            group_mse = (current.float() - stored).pow(2).mean() * weight
            mse = group_mse if mse is None else mse + group_mse
            if "ce" in self.term_names():
                group_ce = pair_contrastive_loss(current, objective.symmetric) * weight
                ce = group_ce if ce is None else ce + group_ce
        self._metrics = {"buffer": float(len(self.buffer)), "replay_groups": float(len(groups))}
        terms = {"der": self.config.alpha * mse}
        if ce is not None:
            terms["ce"] = self.config.beta * ce
        return terms

    def metrics(self) -> dict[str, float]:
        """`buffer`: pairs held; `replay_groups`: tasks in the last replay batch."""
        return dict(self._metrics)

    # ----- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        tasks = sorted(self.pairs)
        state: dict[str, Any] = {
            "buffer": self.buffer.state_dict(),
            "pair_task": tasks,
            "pair_name": [self.pairs[t][0] for t in tasks],
            "pair_a": [self.pairs[t][1] for t in tasks],
            "pair_b": [self.pairs[t][2] for t in tasks],
        }
        if len(self.buffer):
            state.update({name: self.tensors[name] for name in BUFFER_FIELDS})
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buffer.load_state_dict(dict(state["buffer"]))
        columns = [list(state.get(k, [])) for k in ("pair_task", "pair_name", "pair_a", "pair_b")]
        if len({len(column) for column in columns}) != 1:
            raise ValueError(
                f"{self.name} state: task pair fields of different lengths {[len(c) for c in columns]}"
            )
        self.pairs = {int(t): (str(name), str(ma), str(mb)) for t, name, ma, mb in zip(*columns, strict=True)}
        self.tensors = {}
        if len(self.buffer):
            self.tensors = {name: torch.as_tensor(state[name]).float().clone() for name in BUFFER_FIELDS}
        sizes = {len(v) for v in self.tensors.values()} or {0}
        if sizes != {len(self.buffer)}:
            raise ValueError(
                f"{self.name} state: {len(self.buffer)} buffer slots but stored tensors of sizes {sizes}"
            )
        missing = sorted({task for task, _ in self.buffer.refs} - set(self.pairs))
        if missing:
            raise ValueError(f"{self.name} state: buffer slots of task(s) {missing} without a modality pair")
        self._metrics = {}
        self._calls = ((-1, -1), 0)


@register_pair_method
class PairDERPP(PairDER):
    """DER++: DER plus β × the pair objective (same-instance contrastive CE) on the buffer pairs."""

    name = "derpp"
    config_class = PairDERPPConfig

    def term_names(self) -> tuple[str, ...]:
        return ("der", "ce")
