"""SI: Zenke, Poole & Ganguli, "Continual Learning Through Synaptic Intelligence" (ICML 2017).

    ω_k^μ = −Σ_s g_k(s) · (θ_k(s+1) − θ_k(s))      the path integral over task μ's steps    (Zenke et al., Eq. 3)
    Ω_k ← Ω_k + ω_k^μ / ((Δ_k^μ)² + ξ),   Δ^μ = θ(end of μ) − θ(start of μ)                    (Eq. 5)
    L(θ) = L_contrastive(θ) + c Σ_k Ω_k (θ_k − θ*_k)²,   θ* ← θ at the end of task μ            (Eq. 4)

Exact bookkeeping with the one hook that sees gradients, `pre_optimizer_step` (before optimizer step s):
1. if step s−1 is pending, close it: θ now is θ(s), so ω −= g(s−1) ⊙ (θ(s) − θ(s−1));
2. record θ(s) and g(s) = `p.grad` (copies) and mark step s pending.
`on_task_end` closes the task's last step with the final parameters, so every optimizer step contributes exactly
g(s) ⊙ Δθ(s), including the last one; a step the optimizer skips (fp16 overflow) has Δθ = 0 and its non-finite
gradient is recorded as 0. θ(start of μ) is recorded at the task's first step.

g(s) is the gradient the optimizer uses: that of the whole training loss (contrastive, this penalty and any other
method's terms), after gradient clipping and after the gradient edits of the methods listed before `si`. CTP's
re-implementation uses the gradient of the unregularised loss, which "needs to back-pass the gradient twice per
iteration" (specs/ctp.md §4). We use the gradient that moved the parameters, which needs no second backward pass.
Ω is not clipped at 0 (the paper does not clip it). Every process holds the same parameters and gradients, so ω
needs no reduction.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .base import MethodConfig, TaskContext
from .registry import register_method
from .regularization import QuadraticPenaltyConfig, QuadraticPenaltyMethod, nonzero_rows, token_embedding_name

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder


@dataclass
class SIConfig(QuadraticPenaltyConfig):
    c: float = field(
        default=1.0, metadata={"help": "Strength c in c Σ Ω (θ − θ*)² (Zenke Eq. 4); 1 as CTP's code."}
    )
    xi: float = field(
        default=0.1, metadata={"help": "Damping ξ in Ω += ω / (Δ² + ξ) (Zenke Eq. 5); 0.1 as CTP's code."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.c < 0:
            raise ValueError(f"c must be >= 0, got {self.c}")
        if self.xi <= 0:
            raise ValueError(f"xi must be > 0, got {self.xi}")


def _finite_(tensor: torch.Tensor) -> None:
    """Non-finite gradient entries (a step skipped by fp16 loss scaling) count as 0."""
    torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)


class PathIntegral:
    """The running ω of one task: θ and g recorded before each step, closed at the next step or at task end.

    Parameters named in `row_names` (the token embedding) are tracked on the rows with a nonzero gradient at each
    step only: elsewhere g = 0, so those rows add nothing to ω (exactly), and a step costs a few rows, not 49,408.
    """

    def __init__(
        self, names: list[str], params: list[torch.Tensor], row_names: AbstractSet[str | None] = frozenset()
    ):
        self.names = names
        self.start = [p.detach().clone() for p in params]
        self.omega = [torch.zeros_like(p) for p in params]
        self.dense = [i for i, name in enumerate(names) if name not in row_names or params[i].dim() < 2]
        self.by_rows = [i for i in range(len(names)) if i not in set(self.dense)]
        dense = [params[i] for i in self.dense]
        self.previous = [torch.empty_like(p) for p in dense]
        self.gradient = [torch.empty_like(p) for p in dense]
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pending = False

    @torch.no_grad()
    def record(self, params: list[torch.Tensor]) -> None:
        """Before an optimizer step: close the previous step, then record θ(s) and g(s)."""
        self.close(params)
        if self.dense:
            dense = [params[i] for i in self.dense]
            torch._foreach_copy_(self.previous, [p.detach() for p in dense])
            for buffer, param in zip(self.gradient, dense, strict=True):
                if param.grad is None:
                    buffer.zero_()
                else:  # the copy and `_finite_` in one pass
                    torch.nan_to_num(param.grad, nan=0.0, posinf=0.0, neginf=0.0, out=buffer)
        for index in self.by_rows:
            param, grad = params[index].detach(), params[index].grad
            if grad is not None:
                rows = nonzero_rows(grad)
                gradient = grad[rows]
                _finite_(gradient)
                self.rows[index] = (rows, param[rows], gradient)
        self.pending = True

    @torch.no_grad()
    def close(self, params: list[torch.Tensor]) -> None:
        """ω −= g(s) ⊙ (θ(s+1) − θ(s)) for the pending step s, θ(s+1) being `params` now."""
        if not self.pending:
            return
        if self.dense:
            # In place, no temporary the size of the model: previous ← θ(s) − θ(s+1) = −Δθ (IEEE subtraction is
            # antisymmetric, so this is −Δθ exactly), then ω += g ⊙ (−Δθ), bitwise ω − g ⊙ Δθ. `previous` is
            # overwritten by the next `record` before it is read again.
            torch._foreach_sub_(self.previous, [params[i].detach() for i in self.dense])
            torch._foreach_addcmul_([self.omega[i] for i in self.dense], self.gradient, self.previous)
        for index, (rows, previous, gradient) in self.rows.items():
            row_delta = params[index].detach()[rows] - previous
            self.omega[index].index_add_(0, rows, gradient * row_delta, alpha=-1.0)
        self.rows.clear()
        self.pending = False

    @torch.no_grad()
    def importance(self, params: list[torch.Tensor], xi: float) -> dict[str, torch.Tensor]:
        """This task's ω / (Δ² + ξ), Δ the parameters' displacement over the task (Zenke Eq. 5)."""
        self.close(params)
        delta = torch._foreach_sub([p.detach() for p in params], self.start)
        denominator = torch._foreach_add(torch._foreach_mul(delta, delta), xi)
        return dict(zip(self.names, torch._foreach_div(self.omega, denominator), strict=True))


@register_method
class SI(QuadraticPenaltyMethod[SIConfig]):
    """Synaptic Intelligence: importance from each parameter's contribution to the loss drop along the path."""

    fsdp_refusal = ("its importance accumulates each step's gradient times update over the parameters (the path "
                    "integral), which FSDP2 holds as shards during training")
    name = "si"
    test_families = ("metaclip_2",)
    trains_pair_tasks = True  # on pair tasks: the trainable heads, with the pair loss (CMCL's baselines)
    config_class = SIConfig

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.path: PathIntegral | None = None
        self._model: nn.Module | None = None
        self._restored_path: dict[str, Any] | None = None

    @property
    def strength(self) -> float:
        return self.config.c

    def on_task_start(self, context: TaskContext) -> None:
        self.path = None
        self._restored_path = None

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        if self.path is None:
            covered = self.covered_parameters(model)
            self.path = PathIntegral(list(covered), list(covered.values()), {token_embedding_name(model)})
            self._restore_path()
        self._model = model
        self.path.record(self._params(model))

    # ----- mid-task state: θ(start of task) and ω so far, so a task resumed from a Trainer checkpoint is exact -----
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.path is not None and self._model is not None:
            self.path.close(self._params(self._model))  # the pending step ends at the current parameters
            state["path"] = {
                "start": dict(zip(self.path.names, self.path.start, strict=True)),
                "omega": dict(zip(self.path.names, self.path.omega, strict=True)),
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.path = None
        self._restored_path = state.get("path")

    def _restore_path(self) -> None:
        """Continue a task's path integral from a mid-task checkpoint (see `state_dict`)."""
        saved, self._restored_path = self._restored_path, None
        if saved is None:
            return
        path = self._path()
        if set(saved["start"]) != set(path.names):
            raise ValueError("SI mid-task state covers different parameters than the model; resume with the same model")
        for i, name in enumerate(path.names):
            path.start[i].copy_(saved["start"][name])
            path.omega[i].copy_(saved["omega"][name])

    def _path(self) -> PathIntegral:
        """The path integral of the task in progress (opened by the first step)."""
        if self.path is None:
            raise RuntimeError("si: no path integral open (the task has not started training)")
        return self.path

    def on_task_end(self, context: TaskContext) -> None:
        """Close the last step, add ω / (Δ² + ξ) to Ω, anchor θ* at the current parameters."""
        model = context.model
        importance = {} if self.path is None else self.path.importance(self._params(model), self.config.xi)
        self.consolidate(model, importance, rule="sum", gamma=1.0)
        self.path = None
        self._model = None

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        named = dict(model.named_parameters())
        names = self._path().names
        missing = [name for name in names if name not in named]
        if missing:
            raise ValueError(f"SI tracks parameter(s) {missing[:5]} that the model no longer has")
        return [named[name] for name in names]
