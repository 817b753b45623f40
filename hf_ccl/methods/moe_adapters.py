"""MoE-Adapters (Yu et al., CVPR 2024, "Boosting Continual Learning of Vision-Language Models via Mixture-of-Experts
Adapters", arXiv 2403.11549; official code JiazuoYu/MoE-Adapters4CL at 4572d97, `mtil/`, cited below as
`model.py`, `adapter.py`, `finetune.py`, `AutoEncoder.py`, `evaluation.py` and the `train_full_shot_*` script).

**Mixture-of-experts adapters.** The base model is frozen. Every encoder layer of each adapted tower (both towers by
default: the scripts' `--ffn_adapt_where AdapterDoubleEncoder`, `model.py` l. 642) gets `num_experts` bottleneck
adapters (experts, shared by all tasks) and, per task t, a router R^t (`router_list`, `w_noise_list`, `model.py`
l. 334-339). With x the layer's residual stream after attention (what enters `layer_norm2`) and c = x[:, 0] its first
token (`model.py` l. 474):

    R^t(c) = c W_g^t + N(0, 1) * (softplus(c W_noise^t) + 1e-2)          (noise while training only; l. 429-448)
    w^t = Softmax(TopK(R^t(c), k))   scattered back to num_experts gates (exactly k nonzero, summing to 1; l. 449-455)
    E_i(x) = s * W_up,i Dropout(ReLU(W_down,i x + b_down,i)) + s * b_up,i   (`adapter.py` l. 35-60; s = 0.1)
    layer(x) = x + MLP(LN_2(x)) + sum_i w_i^t E_i(x)                      (the adapter parallel to the MLP; l. 511)

(the paper's W^t = Softmax(Topk(R^t(c^t))) and y^t = sum_i W_i^t E_i(x^t)). Each sample's whole token sequence goes
to its top-k experts; the gates are computed from its first token. W_down is Kaiming-uniform, W_up and the biases zero
(`adapter.py` l. 42-47), and the routers start at zero (l. 337-338), so task 0 starts from the frozen model exactly.
It runs on the families whose encoder layers are CLIP's pre-norm `layer_norm1 -> self_attn -> layer_norm2 -> mlp`
(CLIP, SigLIP, SigLIP 2, MetaCLIP 2), installed with two forward hooks per layer (the residual stream is read before
`layer_norm2`, the experts' sum is added to the `mlp` output). AltCLIP and Chinese-CLIP are refused
(`unsupported_methods`): their text towers are post-LayerNorm BERT/XLM-R layers, with no residual stream beside an
`mlp` to put the parallel adapter on. On CLIP's causal text tower the first token is BOS, which attends only to itself,
so every text takes the same route (as in the official code); SigLIP's towers have no CLS token, and their first
token (the first patch, the first word) is mixed with the others by the bidirectional attention.

**Load balance.** Shazeer et al.'s importance and load losses, cv^2(sum_b w_b) + cv^2(load), per adapted layer
(`model.py` l. 369-394 and 481-483), times `balance_weight` (1e-2, the code's `loss *= 1e-2`), summed over layers:
the named loss term `moe_adapters/balance`. The load is the sum of the probabilities of each expert being in the top
k under the noise (`_prob_in_top_k`, l. 396-427) with router noise, the number of samples each expert got without.
The official code computes this loss but never adds it to the training loss (`finetune.py` l. 182 is the
cross-entropy alone): `balance_weight: 0` is the code's variant. With exact gradient accumulation
(`hf_ccl.accumulation`) the term is computed over the whole accumulated batch like every other term.

**Activate-freeze.** Every training forward counts, per layer, how many samples chose each expert (`choose_map_*`,
l. 486-492); after each task the `freeze_top` (2) most chosen experts of each layer join the frozen set and are not
trained by later tasks (`finetune.py` l. 90-101 and 193-220: `torch.topk(choose_map, 2)` appended to the frozen
list). Earlier tasks' routers are frozen too (unused by later tasks, so unchanged in the official code as well).

**DDAS (Distribution Discriminative Auto-Selector).** After each task trains (before it is evaluated), a small
autoencoder AE^t (Linear(P, 100) + ReLU, Linear(100, P) + Sigmoid; `AutoEncoder.py` l. 13-31) is trained on the
frozen model's image features of the task's training data: the normalised image embedding e of the model without
adapters, fed as f = sigmoid(sqrt(P) e) (the code feeds sigmoid(AlexNet conv features), l. 185: this library uses the
frozen model's own embedding instead of an ImageNet AlexNet). Training as the chooser's: Adam with weight decay
1e-4, MSE, batches of 64, lr 0.01 decayed x0.1 every 10 epochs (`exp_lr_scheduler`, l. 49 and 180), 300 steps
(the script's `--iterations 300` for every task's chooser). At inference an image goes to the task whose AE
reconstructs it best, or to the frozen model (route -1) when that error exceeds the threshold (`evaluation.py`
l. 56-71). The code thresholds the best mean squared error with one absolute `--threshold` (0.0655 on its AlexNet
features): `ddas_threshold` sets such a value here; by default (None) each AE gets its own threshold at training,
`ddas_margin` times the `ddas_quantile` quantile of its errors on its own task's features. The code selects one route
per batch (its MSE is the batch's mean, `evaluation.py` l. 61-71): `ddas_selection: batch`; the default routes each
image (`image`, the paper's "routes in-distribution and out-of-distribution inputs"). The code also trains an extra
AE on TinyImageNet as a catch-all for out-of-distribution inputs (the script's `chooser_dataset[0]`); not here.
The texts of a routed image are encoded with the same route (`evaluation.py` l. 21-41 encodes the class texts once
per route).

**Paper vs code, and the options for each.** (1) The balance loss: added with weight 1e-2 by default (the noisy
top-k gating of Shazeer et al. that the paper adopts, with the code's factor); the code computes it and never uses
it: `balance_weight: 0`. (2) DDAS selection per image by default (the paper routes "inputs"); per batch in the code:
`ddas_selection: batch`. (3) DDAS features: the frozen model's own image embedding, not an ImageNet AlexNet (no
option: no AlexNet offline, and the frozen model is the one routed to). (4) The threshold: calibrated per AE by
default, absolute as in the code with `ddas_threshold`. (5) Details kept from the code: the first token routes, the
adapter takes the un-normalised residual stream, dropout 0.1 inside the experts, routers initialised at zero, the 2
most chosen experts per layer frozen after each task. Not kept: the code's adapter hard-codes its down-projection
width to 64 (`adapter.py` l. 35) whatever `--ffn_num` (the same at the default 64; `bottleneck` sets both here);
its 11 routers allocated up front (one per task is added here); its catch-all TinyImageNet AE.

**Routing API** (for evaluators; see each function): `has_routes(model)`, `num_routes(model)`,
`select_routes(model, image_inputs) -> LongTensor[B]` (DDAS per image: a task index, or -1), and the context manager
`use_routes(model, routes)` (an int for every sample, a LongTensor[B] per sample, -1 the frozen model exactly, None
the current task's router). Outside a `use_routes` block: training uses the current task's router; evaluation
follows `eval_routing`: `ddas` (the default with `ddas: true`, the paper): hf_ccl's evaluator routes each eval image by
DDAS and scores it with its route's image and class-prompt embeddings (`MoEAdapterBank.evaluation_routes`,
`hf_ccl.evaluation.routing`; results carry each route's share as `route_<t>` / `route_frozen`), while a forward
outside the evaluator routes images per DDAS and texts through the current router; `current` (the default without
DDAS): the last trained task's router for images and texts alike; `frozen`: the model without adapters.

**Checkpoints.** The experts, routers, AEs, thresholds, choice counts and the frozen set live in `model.moe_adapters`
(a submodule, so they train, move and synchronise with the model) and in the method state (`method_state.safetensors`
beside each checkpoint, restored exactly on resume, mid-task too). They are never written to `model.safetensors`
(`_keys_to_ignore_on_save`; `plain_state_dict` leaves out `moe_adapters.`): every checkpoint is the unchanged frozen
base model, which loads with plain transformers (`CLIPModel.from_pretrained`, ...) as the model WITHOUT the adapters
(the frozen model, route -1), not the model the run scored. `load_moe_model(task_folder)` or
`load_moe_model(repo_id, revision="task-<k>")` returns it with its adapters, routers and DDAS: the model the run
evaluated, which `hf_ccl.evaluation.evaluate_task` scores exactly as `results.json` does. The model card's "How to
use" says so (`MoEAdapters.checkpoint_loader`).

**Sizes.** The adapters may not outnumber the model's own parameters (`check_model`, before the model is built when
its config is local): 10^5 experts are refused up front, not after minutes of allocation.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch
from torch import nn

from ..distributed import all_reduce_sum_
from ..modeling import ContinualDualEncoder
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .loading import CheckpointLoader
from .registry import register_method
from .sizes import parameter_count
from .state import load_checkpoint_method
from .trainable import requires_grad_flags, restore_flags

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoderOutput

logger = logging.getLogger(__name__)

NAME = "moe_adapters"
#: The model attribute that holds the adapters (and the prefix of their parameter names).
BANK = "moe_adapters"
#: Where each tower's encoder layers are, in the families this method supports.
TOWER_LAYERS = {"text": "text_model.encoder.layers", "vision": "vision_model.encoder.layers"}
#: Families refused (`unsupported_methods`), with the reason.
REFUSED_FAMILIES = {
    "altclip": "its text tower is an XLM-R encoder whose post-LayerNorm layers (attention -> intermediate -> output "
               "with LayerNorm after the residual) have no pre-norm residual stream beside an `mlp` for the parallel "
               "MoE adapter",
    "chinese_clip": "its text tower is a BERT encoder whose post-LayerNorm layers (attention -> intermediate -> output "
                    "with LayerNorm after the residual) have no pre-norm residual stream beside an `mlp` for the "
                    "parallel MoE adapter",
}
#: The noise floor of the router's standard deviation (`noisy_top_k_gating(..., noise_epsilon=1e-2)`).
NOISE_EPSILON = 1e-2
#: DDAS autoencoder optimiser (the chooser's, `AutoEncoder.py`): Adam weight decay; lr x0.1 every this many epochs.
DDAS_WEIGHT_DECAY = 1e-4
DDAS_DECAY_EPOCHS = 10
_TOWERS = tuple(TOWER_LAYERS)


def _refuse_families() -> None:
    """Add this method to `unsupported_methods` of the families whose layers it cannot adapt (each with its reason)."""
    from ..families import FAMILIES

    for family, reason in REFUSED_FAMILIES.items():
        cls = FAMILIES[family]
        cls.unsupported_methods = {**cls.unsupported_methods, NAME: reason}


_refuse_families()


# ----------------------------------------------------------------------------------------------------------------
# Gating (Shazeer et al. 2017, as `model.py` implements it)
# ----------------------------------------------------------------------------------------------------------------
def cv_squared(x: torch.Tensor) -> torch.Tensor:
    """The squared coefficient of variation var(x) / (mean(x)^2 + 1e-10) (unbiased variance), 0 for one value
    (`model.py` l. 369-394)."""
    x = x.float()
    if x.shape[0] == 1:
        return x.new_zeros(())
    return x.var() / (x.mean() ** 2 + 1e-10)


def prob_in_top_k(
    clean: torch.Tensor, noisy: torch.Tensor, noise_std: torch.Tensor, top_values: torch.Tensor, k: int
) -> torch.Tensor:
    """P(expert in the top k) per sample and expert under fresh noise (`_prob_in_top_k`, `model.py` l. 396-427):
    Phi((clean - threshold) / std), the threshold being the (k+1)-th largest noisy logit for experts in the top k
    and the k-th largest for the others. Differentiable in the router weights."""
    threshold_in = top_values[:, k : k + 1]
    threshold_out = top_values[:, k - 1 : k]
    is_in = noisy > threshold_in
    prob_in = torch.special.ndtr((clean - threshold_in) / noise_std)
    prob_out = torch.special.ndtr((clean - threshold_out) / noise_std)
    return torch.where(is_in, prob_in, prob_out)


@dataclass
class Gating:
    """One gating decision for a batch: `gates` [B, E] (k nonzero per row, summing to 1), the top-k expert indices
    and their gates [B, k], and the balance statistics: `importance` (sum of gates per expert) and `load`."""

    gates: torch.Tensor
    indices: torch.Tensor
    top_gates: torch.Tensor
    importance: torch.Tensor
    load: torch.Tensor


def noisy_top_k_gating(
    x: torch.Tensor, w_gate: torch.Tensor, w_noise: torch.Tensor | None, k: int, noisy: bool
) -> Gating:
    """Noisy top-k gating of `x` [B, D] (`noisy_top_k_gating`, `model.py` l. 429-458), in float32.

    `w_gate` and `w_noise` are [D, E] or, per sample, [B, D, E]. With `noisy` the logits get
    N(0, 1) * (softplus(x W_noise) + 1e-2) noise and the load is `prob_in_top_k` summed over the batch; without, the
    load is the number of samples each expert got."""
    device_type = x.device.type
    with torch.autocast(device_type=device_type, enabled=False):
        x = x.float()

        def project(weight: torch.Tensor) -> torch.Tensor:
            weight = weight.float()
            return x @ weight if weight.dim() == 2 else torch.einsum("bd,bde->be", x, weight)

        clean = project(w_gate)
        experts = clean.shape[-1]
        if noisy and w_noise is not None:
            noise_std = nn.functional.softplus(project(w_noise)) + NOISE_EPSILON
            logits = clean + torch.randn_like(clean) * noise_std
        else:
            logits = clean
        top_values, top_indices = logits.topk(min(k + 1, experts), dim=1)
        indices = top_indices[:, :k]
        top_gates = torch.softmax(top_values[:, :k], dim=1)
        gates = torch.zeros_like(logits).scatter(1, indices, top_gates)
        if noisy and k < experts:
            load = prob_in_top_k(clean, logits, noise_std, top_values, k).sum(0)
        else:
            load = (gates > 0).sum(0).float()
    return Gating(gates, indices, top_gates, gates.sum(0), load)


def balance_loss(importance: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """cv^2(importance) + cv^2(load) (`model.py` l. 481-482; times the weight outside)."""
    return cv_squared(importance) + cv_squared(load)


class _InjectGradient(torch.autograd.Function):
    """Identity on `output` whose backward also hands `grad_importance` and `grad_load` to `importance` and `load`
    (whatever reaches `output`): how a balance loss computed over a whole accumulated batch reaches each chunk's
    routers (see `MoEAdapters.loss_terms`)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, importance: torch.Tensor, load: torch.Tensor,  # noqa: ANN401
                grad_importance: torch.Tensor, grad_load: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_importance, grad_load)
        ctx.load_needs_grad = load.requires_grad
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN401
        grad_importance, grad_load = ctx.saved_tensors
        return grad_output, grad_importance, grad_load if ctx.load_needs_grad else None, None, None


# ----------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------
class ExpertAdapter(nn.Module):
    """One expert: s * up(Dropout(ReLU(down(x)))) (`Adapter` of `adapter.py`, `adapter_layernorm_option='none'`,
    `add_residual=False`), LoRA-style init: Kaiming-uniform `down_proj.weight`, zero `up_proj` and biases."""

    def __init__(self, dim: int, bottleneck: int, scale: float, dropout: float,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.down_proj = nn.Linear(dim, bottleneck)
        self.up_proj = nn.Linear(bottleneck, dim)
        self.scale = scale
        self.dropout = dropout
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down_proj.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.down_proj.bias)
            nn.init.zeros_(self.up_proj.weight)
            nn.init.zeros_(self.up_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This expert alone (the layer computes all of a sample's experts at once, `MoELayer.mixture`)."""
        hidden = nn.functional.dropout(torch.relu(self.down_proj(x)), self.dropout, self.training)
        return self.up_proj(hidden) * self.scale


class RoutingState:
    """What routes the forwards of one model, shared by its `MoELayer`s (a plain object: a deep copy of the model
    gets its own)."""

    DEFAULT = "default"  #: no `use_routes` block
    CURRENT = "current"  #: `use_routes(model, None)`

    def __init__(self, eval_routing: str = "current") -> None:
        self.routes: str | int | torch.Tensor = self.DEFAULT
        self.current_task = 0
        self.eval_routing = eval_routing
        #: Per-sample routes a tower's pre-hook set for its own forward (`eval_routing: ddas`).
        self.tower_routes: dict[str, torch.Tensor] = {}
        self.selecting = False
        #: Whether training forwards record the balance statistics (`balance_weight > 0`).
        self.record_balance = False
        #: (layer key, importance, load, with gradients) of the training forwards since the last `loss_terms`.
        self.records: list[tuple[str, torch.Tensor, torch.Tensor, bool]] = []
        #: Exact accumulation: per layer, the balance loss's gradients with respect to the whole batch's importance
        #: and load, and how many chunk forwards still have to receive them.
        self.pending: dict[str, list[Any]] = {}

    def is_default(self) -> bool:
        """Whether no `use_routes` block is active."""
        return isinstance(self.routes, str) and self.routes == self.DEFAULT

    def resolve(self, tower: str, training: bool) -> int | torch.Tensor:
        """The route of a forward through `tower`: an int for every sample or a LongTensor per sample."""
        routes = self.routes
        if not isinstance(routes, str):
            return routes
        if routes == self.CURRENT or training:
            return self.current_task
        if tower in self.tower_routes:
            return self.tower_routes[tower]
        return -1 if self.eval_routing == "frozen" else self.current_task

    def is_training_default(self, training: bool) -> bool:
        """Whether a forward is a training forward on the current task's router (the only ones counted)."""
        return training and isinstance(self.routes, str)

    def describe(self) -> str:
        routes = self.routes
        shown = routes.tolist() if isinstance(routes, torch.Tensor) else routes
        return f"routes={shown}, current_task={self.current_task}, eval_routing={self.eval_routing}"


class MoELayer(nn.Module):
    """The experts and the per-task routers of one encoder layer (see the module docstring), run by two hooks on
    the layer: `stash_input` (a forward pre-hook of `layer_norm2`: the residual stream x) and `add_mixture` (a
    forward hook of `mlp`: its output plus sum_i w_i E_i(x))."""

    def __init__(self, key: str, tower: str, dim: int, config: MoEAdaptersConfig, state: RoutingState,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.key, self.tower, self.dim = key, tower, dim
        self.top_k = config.top_k
        self.router_noise = config.router_noise
        self.experts = nn.ModuleList(
            ExpertAdapter(dim, config.bottleneck, config.adapter_scale, config.dropout, generator)
            for _ in range(config.num_experts))
        self.routers = nn.ParameterList()  # router_list: W_g^t [D, E]
        self.noise = nn.ParameterList()  # w_noise_list: W_noise^t [D, E]
        self.frozen: torch.Tensor  # a buffer: which experts are frozen
        self.register_buffer("frozen", torch.zeros(config.num_experts, dtype=torch.bool))
        self.state = state
        #: Samples that chose each expert in this task's training forwards, over every process (`step_counts`, this
        #: process's since the last optimizer step, are summed over processes into it at each step). Plain tensors,
        #: not buffers: DDP would overwrite every process's with the first one's.
        self.counts = torch.zeros(config.num_experts, dtype=torch.int64)
        self.step_counts = torch.zeros(config.num_experts, dtype=torch.int64)
        self._input: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def expert_adapters(self) -> list[ExpertAdapter]:
        """`experts` (an `nn.ModuleList` of `ExpertAdapter`s), typed."""
        return cast("list[ExpertAdapter]", list(self.experts))

    def add_router(self) -> None:
        """A zero-initialised router (and noise weights) for the next task (`model.py` l. 337-338)."""
        reference = self.frozen.device
        dtype = self.expert_adapters[0].down_proj.weight.dtype
        for holder in (self.routers, self.noise):
            holder.append(nn.Parameter(torch.zeros(self.dim, self.num_experts, device=reference, dtype=dtype)))

    # ----- hooks --------------------------------------------------------------------------------------------
    def stash_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._input = args[0]

    def add_mixture(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x, self._input = self._input, None
        if x is None:
            raise RuntimeError(f"MoE adapter {self.key}: the mlp ran without layer_norm2 before it")
        state = self.state
        routes = state.resolve(self.tower, self.training)
        if isinstance(routes, int):
            if routes < 0:
                return output
            gating = noisy_top_k_gating(x[:, 0], self.routers[routes], self.noise[routes], self.top_k,
                                        self.router_noise and self.training)
            mixture = self.mixture(x, gating)
            if state.is_training_default(self.training):
                output = self._record(output, gating)
            return output + mixture.to(output.dtype)
        if routes.shape[0] != x.shape[0]:
            raise ValueError(f"use_routes: {routes.shape[0]} routes for a batch of {x.shape[0]} samples")
        routes = routes.to(x.device)
        index = routes.clamp(min=0)
        gating = noisy_top_k_gating(x[:, 0], torch.stack(list(self.routers))[index],
                                    torch.stack(list(self.noise))[index], self.top_k,
                                    self.router_noise and self.training)
        mixture = self.mixture(x, gating).to(output.dtype)
        return torch.where((routes >= 0)[:, None, None], output + mixture, output)

    def mixture(self, x: torch.Tensor, gating: Gating) -> torch.Tensor:
        """sum_i w_i E_i(x) [B, L, D]: each sample through its top-k experts only (their weights gathered per
        sample: no host synchronisation, and every expert gets a (zero) gradient, as DDP expects)."""
        experts = self.expert_adapters
        index, gates = gating.indices, gating.top_gates
        down_w = torch.stack([e.down_proj.weight for e in experts])[index]  # [B, k, r, D]
        down_b = torch.stack([e.down_proj.bias for e in experts])[index]  # [B, k, r]
        up_w = torch.stack([e.up_proj.weight for e in experts])[index]  # [B, k, D, r]
        up_b = torch.stack([e.up_proj.bias for e in experts])[index]  # [B, k, D]
        hidden = torch.relu(torch.einsum("bld,bkrd->bklr", x, down_w) + down_b[:, :, None, :])
        hidden = nn.functional.dropout(hidden, experts[0].dropout, self.training)
        gates = gates.to(hidden.dtype)
        out = torch.einsum("bklr,bkdr->bld", hidden * gates[:, :, None, None], up_w)
        out = out + torch.einsum("bk,bkd->bd", gates, up_b.to(gates.dtype))[:, None, :]
        return out * experts[0].scale

    def _record(self, output: torch.Tensor, gating: Gating) -> torch.Tensor:
        """Training forward on the current router: count the choices (forwards with gradients only: an exact
        accumulation step encodes each chunk twice) and record or inject the balance statistics."""
        state = self.state
        if torch.is_grad_enabled():
            if self.step_counts.device != gating.gates.device:
                self.step_counts = self.step_counts.to(gating.gates.device)
            self.step_counts += (gating.gates > 0).sum(0)
        if not state.record_balance:
            return output
        pending = state.pending.get(self.key)
        if pending is not None and torch.is_grad_enabled():
            grad_importance, grad_load, remaining = pending
            output = _InjectGradient.apply(output, gating.importance, gating.load, grad_importance, grad_load)
            if remaining <= 1:
                del state.pending[self.key]
            else:
                pending[2] = remaining - 1
            return output
        state.records.append((self.key, gating.importance, gating.load, torch.is_grad_enabled()))
        return output


class AutoEncoder(nn.Module):
    """A DDAS autoencoder (`Autoencoder` of `AutoEncoder.py` l. 13-31): Linear + ReLU, Linear + Sigmoid."""

    def __init__(self, dim: int, code_dim: int, generator: torch.Generator | None = None):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, code_dim), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(code_dim, dim), nn.Sigmoid())
        with torch.no_grad():  # nn.Linear's own init, from `generator`
            for linear in (self.encoder_linear, cast(nn.Linear, self.decoder[0])):
                nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5), generator=generator)
                bound = 1 / math.sqrt(linear.in_features)
                nn.init.uniform_(linear.bias, -bound, bound, generator=generator)

    @property
    def encoder_linear(self) -> nn.Linear:
        """The encoder's linear layer (`encoder[0]`)."""
        return cast(nn.Linear, self.encoder[0])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(features))

    def errors(self, features: torch.Tensor) -> torch.Tensor:
        """Per-row mean squared reconstruction error [B] (the code's `encoder_criterion`, per row)."""
        features = features.to(self.encoder_linear.weight.dtype)
        return (self(features) - features).pow(2).mean(-1)


class MoEAdapterBank(nn.Module):
    """Everything the method adds to a model, as `model.moe_adapters`: a `MoELayer` per adapted encoder layer
    (`layers["<tower>_<index>"]`), the DDAS autoencoders and their thresholds, and the routing state."""

    def __init__(self, config: MoEAdaptersConfig):
        super().__init__()
        if config.eval_routing is None:
            raise ValueError("MoEAdaptersConfig.eval_routing is resolved in __post_init__, not None")
        self.state = RoutingState(config.eval_routing)
        self.state.record_balance = config.balance_weight > 0
        self.layers = nn.ModuleDict()
        self.autoencoders = nn.ModuleList()
        self.thresholds: torch.Tensor  # a buffer: each autoencoder's DDAS threshold
        self.register_buffer("thresholds", torch.zeros(0))
        self.ddas_threshold = config.ddas_threshold
        self.ddas_selection = config.ddas_selection
        self._image_projection: tuple[nn.Module | None, ...] = (None,)

    @property
    def moe_layers(self) -> dict[str, MoELayer]:
        """`layers` (an `nn.ModuleDict` of `MoELayer`s by key), typed."""
        return cast("dict[str, MoELayer]", dict(self.layers.items()))

    @property
    def ddas_autoencoders(self) -> list[AutoEncoder]:
        """`autoencoders` (an `nn.ModuleList` of `AutoEncoder`s), typed."""
        return cast("list[AutoEncoder]", list(self.autoencoders))

    @property
    def num_routes(self) -> int:
        """How many task routers each layer has."""
        return len(next(iter(self.moe_layers.values())).routers) if len(self.layers) else 0

    @property
    def _active_adapter(self) -> str:
        """The routing state, under the name `hf_ccl.evaluation.fingerprint` reads as an adapter switch: cached
        embeddings are never reused across routes."""
        return self.state.describe()

    # ----- DDAS -------------------------------------------------------------------------------------------------
    def add_autoencoder(self, autoencoder: AutoEncoder, threshold: float) -> None:
        reference = self.thresholds
        self.autoencoders.append(autoencoder.to(reference.device))
        self.thresholds = torch.cat([reference, reference.new_tensor([threshold])])

    def select(self, embeddings: torch.Tensor) -> torch.Tensor:
        """DDAS routes [B] of normalised frozen image embeddings: argmin_t of AE^t's reconstruction error, or -1
        where that error exceeds the threshold (per image, or one route for the batch with `ddas_selection:
        batch`)."""
        if not len(self.autoencoders):
            raise ValueError("DDAS has no autoencoder yet: one is trained after each task (`ddas: true`)")
        features = ddas_features(embeddings)
        errors = torch.stack([ae.errors(features).float() for ae in self.ddas_autoencoders], dim=1)  # [B, T]
        if self.ddas_selection == "batch":
            errors = errors.mean(0, keepdim=True)
        best_error, best = errors.min(dim=1)
        limit = (torch.full_like(best_error, self.ddas_threshold) if self.ddas_threshold is not None
                 else self.thresholds.to(best_error.device)[best])
        routes = torch.where(best_error > limit, torch.full_like(best, -1), best)
        return routes.expand(embeddings.shape[0]) if self.ddas_selection == "batch" else routes

    # ----- the evaluator's routing (hf_ccl.evaluation.routing.EvaluationRouter) ------------------------------
    def evaluation_routes(self, frozen_image_embeds: torch.Tensor) -> torch.Tensor | None:
        """With `eval_routing: ddas` and at least one autoencoder, the DDAS route of every eval image: the evaluator
        then scores each route's images with that route's image AND text embeddings (the paper's and the official
        evaluation's pairing). None otherwise (the model's default routing applies)."""
        if self.state.eval_routing != "ddas" or not len(self.autoencoders) or self.num_routes == 0:
            return None
        return self.select(frozen_image_embeds.to(self.thresholds.device))

    def evaluation_route(self, model: nn.Module, route: int) -> contextlib.AbstractContextManager[None]:
        """`use_routes(model, route)`: every forward inside takes `route` (-1: the frozen model)."""
        return use_routes(model, route)

    def ddas_pre_hook(self, vision_model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """`eval_routing: ddas`: route the images of an eval forward through `select` (their frozen embeddings
        first: the vision tower without adapters, and the image projection)."""
        state = self.state
        if (self.training or state.selecting or state.eval_routing != "ddas" or not state.is_default()
                or not len(self.autoencoders)):
            return
        state.selecting = True
        previous, state.routes = state.routes, -1
        try:
            with torch.no_grad():
                outputs = vision_model(*args, **kwargs)
                pooled = outputs.pooler_output if hasattr(outputs, "pooler_output") else outputs[1]
                projection = self._image_projection[0]
                embeddings = projection(pooled) if projection is not None else pooled
                state.tower_routes["vision"] = self.select(nn.functional.normalize(embeddings.float(), dim=-1))
        finally:
            state.routes, state.selecting = previous, False

    def ddas_post_hook(self, vision_model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.state.selecting:
            self.state.tower_routes.pop("vision", None)

    # ----- structure ----------------------------------------------------------------------------------------
    def grow(self, num_routes: int, num_autoencoders: int, code_dim: int, feature_dim: int | None) -> None:
        """Add routers and (empty) autoencoders up to the given counts (before loading a saved state)."""
        for layer in self.moe_layers.values():
            while len(layer.routers) < num_routes:
                layer.add_router()
        if num_autoencoders > len(self.autoencoders):
            if feature_dim is None:
                raise ValueError("cannot rebuild DDAS autoencoders without their feature size")
            while len(self.autoencoders) < num_autoencoders:  # overwritten by the saved weights
                with torch.random.fork_rng(devices=[]):
                    self.add_autoencoder(AutoEncoder(feature_dim, code_dim), 0.0)


def fold_step_counts(bank: MoEAdapterBank) -> None:
    """Add every process's expert choices since the last optimizer step to each layer's `counts` (one all-reduce),
    so that the counts, and the experts they freeze, are the same on every process."""
    layers = list(bank.moe_layers.values())
    if not layers:
        return
    device = layers[0].frozen.device
    steps = all_reduce_sum_(torch.stack([moe.step_counts.to(device) for moe in layers]))
    for moe, step in zip(layers, steps, strict=True):
        moe.counts = moe.counts.to(device) + step
        moe.step_counts = torch.zeros_like(moe.counts)


def ddas_features(embeddings: torch.Tensor) -> torch.Tensor:
    """The autoencoders' input: sigmoid(sqrt(P) e) of normalised embeddings e [B, P] (unit mean square per
    coordinate before the sigmoid; the code feeds sigmoid(features), `AutoEncoder.py` l. 185)."""
    embeddings = embeddings.float()
    return torch.sigmoid(embeddings * math.sqrt(embeddings.shape[-1]))


# ----------------------------------------------------------------------------------------------------------------
# The routing API
# ----------------------------------------------------------------------------------------------------------------
def moe_bank(model: nn.Module) -> MoEAdapterBank | None:
    """The model's `MoEAdapterBank`, or None."""
    bank = getattr(model, BANK, None)
    return bank if isinstance(bank, MoEAdapterBank) else None


def _bank(model: nn.Module) -> MoEAdapterBank:
    bank = moe_bank(model)
    if bank is None or bank.num_routes == 0:
        raise ValueError(f"the model has no MoE adapters ({type(model).__name__}.{BANK}): train it with the "
                         f"'{NAME}' method or load it with load_moe_model")
    return bank


def has_routes(model: nn.Module) -> bool:
    """Whether `model` carries MoE adapters with at least one task router (so that `use_routes` applies)."""
    bank = moe_bank(model)
    return bank is not None and bank.num_routes > 0


def num_routes(model: nn.Module) -> int:
    """How many task routers the model has (routes 0 .. n-1; -1 is the frozen model); 0 without adapters."""
    bank = moe_bank(model)
    return 0 if bank is None else bank.num_routes


@contextlib.contextmanager
def use_routes(model: nn.Module, routes: int | torch.Tensor | None) -> Iterator[None]:
    """Inside the block every forward through `model` (images and texts, `embed_images`, `embed_texts`,
    `get_*_features`, `model(...)`) uses `routes`:

    - an int for every sample: a task index t (its router R^t and the shared experts), or -1: no adapters, i.e.
      exactly the frozen pre-adapter model;
    - a LongTensor [B]: per sample (every forward in the block must then have B samples; sample b of an image batch
      and of a text batch both take `routes[b]`);
    - None: the training default, the current task's router.

    Blocks nest; the previous routing is restored on exit. Forwards inside a block never count expert choices or
    record the balance loss."""
    bank = _bank(model)
    count = bank.num_routes
    if isinstance(routes, torch.Tensor):
        if routes.dim() != 1 or routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"use_routes: per-sample routes must be a 1-D integer tensor, got {routes.dtype} of "
                             f"shape {tuple(routes.shape)}")
        if routes.numel() and (int(routes.min()) < -1 or int(routes.max()) >= count):
            raise ValueError(f"use_routes: routes must be in [-1, {count - 1}], got {routes.tolist()}")
        value: str | int | torch.Tensor = routes.long()
    elif routes is None:
        value = RoutingState.CURRENT
    elif isinstance(routes, int) and not isinstance(routes, bool):
        if not -1 <= routes < count:
            raise ValueError(f"use_routes: route {routes} is not -1 or a trained task's router (0..{count - 1})")
        value = routes
    else:
        raise TypeError(f"use_routes: routes must be an int, a LongTensor or None, got {type(routes).__name__}")
    state = bank.state
    previous, state.routes = state.routes, value
    try:
        yield
    finally:
        state.routes = previous


@torch.no_grad()
def select_routes(model: ContinualDualEncoder, image_inputs: Mapping[str, Any]) -> torch.Tensor:
    """DDAS (`evaluation.py` l. 56-71): per image of `image_inputs` (what `model.embed_images(**...)` takes), the
    index of the task whose autoencoder reconstructs the image's frozen embedding best, or -1 (the frozen model)
    when that error exceeds the threshold. A LongTensor [B] on the images' device, for `use_routes`."""
    bank = _bank(model)
    was_training = model.training
    model.eval()
    try:
        with use_routes(model, -1):
            embeddings = model.embed_images(**image_inputs)
    finally:
        model.train(was_training)
    return bank.select(embeddings)


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class MoEAdaptersConfig(MethodConfig):
    num_experts: int = field(default=22, metadata={"help": "Experts per adapted layer, shared by all tasks "
                                                           "(--experts_num 22)."})
    top_k: int = field(default=2, metadata={"help": "Experts per sample (--topk 2)."})
    bottleneck: int = field(default=64, metadata={"help": "Each expert's bottleneck width (--ffn_num 64)."})
    adapter_scale: float = field(default=0.1, metadata={"help": "Scale s of each expert's output (adapter_scalar "
                                                                "0.1)."})
    dropout: float = field(default=0.1, metadata={"help": "Dropout on the experts' hidden units (Adapter "
                                                          "dropout=0.1)."})
    towers: list[str] = field(
        default_factory=lambda: ["text", "vision"],
        metadata={"help": "Towers whose encoder layers get MoE adapters (the scripts' AdapterDoubleEncoder: both; "
                          "AdapterImageEncoder: [vision])."},
    )
    router_noise: bool = field(default=True, metadata={"help": "Noisy top-k gating while training (noisy_gating)."})
    balance_weight: float = field(
        default=1e-2,
        metadata={"help": "Weight of the load-balancing loss cv^2(importance) + cv^2(load), summed over layers (the "
                          "code's `loss *= 1e-2`); 0: the official code, which computes it but never adds it."},
    )
    freeze_top: int = field(default=2, metadata={"help": "After each task, freeze the experts each layer chose most "
                                                         "often in it (finetune.py: torch.topk(choose_map, 2)); 0: "
                                                         "no freezing."})
    ddas: bool = field(default=True, metadata={"help": "Train a DDAS autoencoder after each task (select_routes)."})
    ddas_code_dim: int = field(default=100, metadata={"help": "DDAS autoencoder code size (code_dims=100)."})
    ddas_steps: int = field(default=300, metadata={"help": "DDAS autoencoder training steps (--iterations 300)."})
    ddas_batch_size: int = field(default=64, metadata={"help": "DDAS autoencoder batch size (--batch-size 64)."})
    ddas_lr: float = field(default=0.01, metadata={"help": "DDAS autoencoder Adam lr, x0.1 every 10 epochs "
                                                           "(exp_lr_scheduler(..., 0.01))."})
    ddas_max_examples: int | None = field(
        default=None, metadata={"help": "Train each autoencoder on at most this many of the task's training images "
                                        "(a seeded subset); None: all."})
    ddas_threshold: float | None = field(
        default=None,
        metadata={"help": "Absolute threshold on the best reconstruction error (the code's --threshold, 0.0655 on "
                          "its AlexNet features; this feature space needs its own value). None: per autoencoder, "
                          "ddas_margin x the ddas_quantile quantile of its errors on its task's training images."},
    )
    ddas_quantile: float = field(default=0.99, metadata={"help": "Quantile of the calibrated thresholds."})
    ddas_margin: float = field(default=1.5, metadata={"help": "Factor of the calibrated thresholds."})
    ddas_selection: Literal["image", "batch"] = field(
        default="image",
        metadata={"help": "'image': a route per image (the paper); 'batch': one route per batch from the batch's "
                          "mean errors (the official evaluation.py)."},
    )
    eval_routing: Literal["current", "frozen", "ddas"] | None = field(
        default=None,
        metadata={"help": "How evaluation routes (null: 'ddas' with ddas, else 'current'): 'ddas' (the paper: each "
                          "image by the auto-selector; the evaluator "
                          "scores each route's images with that route's class prompts, hf_ccl.evaluation.routing; "
                          "outside the evaluator, images per DDAS and texts on the current router), 'current' (the "
                          "last trained task's router, images and texts) or 'frozen' (no adapters)."},
    )

    def __post_init__(self) -> None:
        check_range("num_experts", self.num_experts, 1)
        check_range("top_k", self.top_k, 1, self.num_experts, also=f"(num_experts is {self.num_experts})")
        check_range("bottleneck", self.bottleneck, 1)
        if not math.isfinite(self.adapter_scale):
            raise ConfigError(f"adapter_scale must be finite, got {self.adapter_scale}", "adapter_scale")
        check_range("dropout", self.dropout, 0.0, 1.0, high_open=True)
        if not self.towers or any(tower not in _TOWERS for tower in self.towers) or \
                len(set(self.towers)) != len(self.towers):
            raise ConfigError(f"towers must be a non-empty list of distinct towers among {list(_TOWERS)}, got "
                              f"{self.towers}", "towers")
        check_range("balance_weight", self.balance_weight, 0.0)
        check_range("freeze_top", self.freeze_top, 0, self.num_experts, also=f"(num_experts is {self.num_experts})")
        check_range("ddas_code_dim", self.ddas_code_dim, 1)
        check_range("ddas_steps", self.ddas_steps, 1)
        check_range("ddas_batch_size", self.ddas_batch_size, 1)
        check_range("ddas_lr", self.ddas_lr, 0.0, low_open=True)
        check_range("ddas_max_examples", self.ddas_max_examples, 1)
        check_range("ddas_threshold", self.ddas_threshold, 0.0, low_open=True, also="or null")
        check_range("ddas_quantile", self.ddas_quantile, 0.0, 1.0, low_open=True)
        check_range("ddas_margin", self.ddas_margin, 0.0, low_open=True)
        if self.eval_routing is None:
            self.eval_routing = "ddas" if self.ddas else "current"
        if self.eval_routing == "ddas" and not self.ddas:
            raise ConfigError("eval_routing 'ddas' needs ddas: true", "eval_routing")


class EncoderLayer(Protocol):
    """A CLIP-style pre-norm encoder layer, as the adapters hook it (`check_layers` checks each)."""

    layer_norm2: nn.LayerNorm
    mlp: nn.Module


def check_layers(model: nn.Module, towers: list[str]) -> dict[str, list[EncoderLayer]]:
    """Each tower's encoder layers, checked to have the pre-norm `layer_norm2` -> `mlp` structure."""
    family = getattr(model, "family", type(model).__name__)
    found = {}
    for tower in towers:
        try:
            layers = model.get_submodule(TOWER_LAYERS[tower])
        except AttributeError:
            layers = None
        if not isinstance(layers, nn.ModuleList) or not len(layers) or not all(
                isinstance(getattr(layer, "layer_norm2", None), nn.LayerNorm) and
                isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers):
            raise ValueError(f"{NAME}: the {family} {tower} tower has no CLIP-style encoder layers "
                             f"({TOWER_LAYERS[tower]}.<i>.layer_norm2 and .mlp) for the parallel MoE adapters")
        found[tower] = [cast(EncoderLayer, layer) for layer in layers]
    return found


def added_parameters(model: nn.Module, config: MoEAdaptersConfig) -> int:
    """Parameters the adapters add to `model` (meta or real) for its first task: every adapted layer's experts
    (E x (2 D r + r + D)) and one router with its noise weights (2 D E), and one DDAS autoencoder (2 P c + P + c on
    the P-dimensional embedding, with `ddas`). Later tasks add a router set and an autoencoder each."""
    total = 0
    for layers in check_layers(model, config.towers).values():
        for layer in layers:
            dim = layer.layer_norm2.normalized_shape[0]
            total += config.num_experts * (2 * dim * config.bottleneck + config.bottleneck + dim)
            total += 2 * dim * config.num_experts
    if config.ddas:
        embed_dim = int(getattr(model, "embed_dim", 0))
        total += 2 * embed_dim * config.ddas_code_dim + embed_dim + config.ddas_code_dim
    return total


def install_moe_adapters(model: nn.Module, config: MoEAdaptersConfig, seed: int = 0) -> MoEAdapterBank:
    """Add a `MoEAdapterBank` (no routers yet) to `model` as `model.moe_adapters`, hooked into every encoder layer
    of `config.towers`; the experts are initialised from `seed`. The adapters are kept out of `save_pretrained`."""
    if moe_bank(model) is not None:
        raise ValueError(f"the model already has MoE adapters ({BANK})")
    generator = torch.Generator().manual_seed(int(seed))
    bank = MoEAdapterBank(config)
    towers = check_layers(model, config.towers)
    for tower, layers in towers.items():
        for index, layer in enumerate(layers):
            key = f"{tower}_{index}"
            dim = layer.layer_norm2.normalized_shape[0]
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init would draw from the global generator
                moe = MoELayer(key, tower, dim, config, bank.state, generator)
            bank.layers[key] = moe
            layer.layer_norm2.register_forward_pre_hook(moe.stash_input)
            layer.mlp.register_forward_hook(moe.add_mixture)
    vision = getattr(model, "vision_model", None)
    if vision is not None:
        projection = model.projection("image") if isinstance(model, ContinualDualEncoder) else None
        bank._image_projection = (projection,)
        vision.register_forward_pre_hook(bank.ddas_pre_hook, with_kwargs=True)
        vision.register_forward_hook(bank.ddas_post_hook)
    reference = next(next(iter(towers.values()))[0].mlp.parameters())
    bank.to(device=reference.device, dtype=reference.dtype)
    for moe in bank.moe_layers.values():
        moe.counts, moe.step_counts = moe.counts.to(reference.device), moe.step_counts.to(reference.device)
    setattr(model, BANK, bank)
    _ignore_on_save(model)
    return bank


def _ignore_on_save(model: nn.Module) -> None:
    """Keep every `moe_adapters.` key out of `save_pretrained` (transformers' `_keys_to_ignore_on_save`)."""
    bank = moe_bank(model)
    ignored = {key for key in (getattr(model, "_keys_to_ignore_on_save", None) or ()) if not key.startswith(BANK + ".")}
    if bank is not None:
        ignored |= {f"{BANK}.{key}" for key in bank.state_dict()}
    # torch types nn.Module.__setattr__'s value as Tensor | Module
    setattr(model, "_keys_to_ignore_on_save", ignored)  # noqa: B010


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters of the model: `total`, `base` (without the adapters), `adapters` (experts, routers, noise
    weights, autoencoders) and `trainable` (requires_grad)."""
    total = sum(p.numel() for p in model.parameters())
    bank = moe_bank(model)
    adapters = sum(p.numel() for p in bank.parameters()) if bank is not None else 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "base": total - adapters, "adapters": adapters, "trainable": trainable}


@register_method
class MoEAdapters(ContinualMethod[MoEAdaptersConfig]):
    """Mixture-of-experts adapters with task routers, activate-freeze and DDAS (see the module docstring)."""

    fsdp_refusal = ("its adapters and router are modules attached to the model, which the plain model the loop gathers "
                    "after each task would not carry")
    name = NAME
    test_options = {"num_experts": 4, "bottleneck": 4, "router_noise": False, "dropout": 0.0, "ddas_steps": 20,
                    "ddas_code_dim": 8}  # a few small experts, a short DDAS autoencoder
    test_families = ("siglip2",)
    config_class = MoEAdaptersConfig
    roles = {
        "previous_model": "adds its experts and a router per task to the previous task's model",
        "parameter_efficient": "freezes the model but for its MoE adapters and the current task's router",
    }
    conflicts = {"parameter_efficient": "freezes the model but for its MoE adapters: each would freeze the other's "
                 "parameters"}

    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_moe_model",
        keeps="its experts, per-task routers and DDAS auto-selector",
        plain_model="the base model without the adapters (MoE-Adapters' frozen model, route -1)")

    def __init__(self, config: MoEAdaptersConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self._state: dict[str, Any] | None = None  # a loaded state not yet installed into a model
        self._bank: MoEAdapterBank | None = None
        self._flags: dict[str, bool] = {}
        self.counts: dict[str, int] = {}

    # ----- hooks --------------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        """The adapters may not outnumber the parameters of the model they adapt (the bound of a parameter-efficient
        method: past it, training them needs more memory than fine-tuning the model itself)."""
        try:
            added = added_parameters(model, self.config)
        except ValueError as error:  # a family without CLIP-style layers: refused with its reason
            raise ConfigError(str(error), "methods") from None
        base = parameter_count(model, skip_prefix=BANK + ".")
        if added > base:
            option = "num_experts" if self.config.num_experts >= self.config.bottleneck else "bottleneck"
            raise ConfigError(
                f"method_args.{NAME}: num_experts={self.config.num_experts} experts of bottleneck "
                f"{self.config.bottleneck} per adapted layer add {added:,} parameters, more than the {base:,} of the "
                f"model they adapt (a parameter-efficient method adds fewer): lower num_experts or bottleneck",
                f"method_args.{NAME}.{option}")

    def on_task_start(self, context: TaskContext) -> None:
        """Install the adapters (first task, or the first after a resume, from the method state), add this task's
        zero router, and freeze everything but the current router and the experts not frozen yet."""
        model = context.model
        bank = moe_bank(model)
        if bank is None:
            self.check_model(model)
            self._flags = requires_grad_flags(model)
            bank = install_moe_adapters(model, self.config, seed=context.seed)
        else:
            self._flags = {name: flag for name, flag in requires_grad_flags(model).items()
                           if not name.startswith(BANK + ".")}
        if self._state is not None and bank is not self._bank:  # restored from a checkpoint's method state
            self._load_into(bank, self._state)
        self._bank, self._state = bank, None
        index = context.task_index
        if bank.num_routes > index + 1:
            raise ValueError(f"{NAME}: the model has routers for {bank.num_routes} tasks at the start of task {index}")
        bank.grow(index + 1, len(bank.autoencoders), self.config.ddas_code_dim, None)
        bank.state.current_task = index
        _ignore_on_save(model)
        model.requires_grad_(False)
        for moe in bank.moe_layers.values():
            moe.counts = torch.zeros_like(moe.counts)
            moe.step_counts = torch.zeros_like(moe.step_counts)
            moe.routers[index].requires_grad_(True)
            moe.noise[index].requires_grad_(self.config.router_noise)
            for expert, frozen in zip(moe.expert_adapters, moe.frozen.tolist(), strict=True):
                expert.requires_grad_(not frozen)
        self.counts = parameter_counts(model)
        logger.info("%s, task %d: %d trainable parameters (%.3f%% of the %d of the base model; %d in the adapters, "
                    "routers and autoencoders)", NAME, index, self.counts["trainable"],
                    100 * self.counts["trainable"] / max(self.counts["base"], 1), self.counts["base"],
                    self.counts["adapters"])

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        """`balance`: `balance_weight` x sum over layers of cv^2(importance) + cv^2(load) of this step's batch
        (the importance and load of every training forward since the last call, summed per layer).

        With exact accumulation the chunks are first encoded without gradients: their statistics join the whole
        batch's as leaves, and the term's gradients with respect to them are handed to the chunks' second,
        differentiable forwards (`_InjectGradient`), so that 32 x 2 trains as 64 x 1. Statistics of forwards that
        ran with gradients (one batch, or texts a loss encodes itself, e.g. class prompts) stay in the graph."""
        if self.config.balance_weight == 0:
            return {}
        bank = _bank(model)
        state = bank.state
        records, state.records = state.records, []
        if not records:
            return {"balance": bank.thresholds.new_zeros((), dtype=torch.float32)}
        live: dict[str, list[Any]] = {}  # per layer: summed importance and load, in the graph
        detached: dict[str, list[Any]] = {}  # per layer: summed importance and load without graph, and the count
        for key, importance, load, differentiable in records:
            if differentiable:
                sums = live.setdefault(key, [0, 0])
            else:
                sums = detached.setdefault(key, [0, 0, 0])
                sums[2] += 1
            sums[0], sums[1] = sums[0] + importance, sums[1] + load
        leaves = {key: (importance.detach().requires_grad_(True), load.detach().requires_grad_(True))
                  for key, (importance, load, _) in detached.items()}
        losses = []
        for key in {**live, **leaves}:
            importance = live.get(key, [0, 0])[0] + (leaves[key][0] if key in leaves else 0)
            load = live.get(key, [0, 0])[1] + (leaves[key][1] if key in leaves else 0)
            losses.append(balance_loss(importance, load))
        term = self.config.balance_weight * sum(losses[1:], losses[0])  # every record's layer has a loss
        if leaves and torch.is_grad_enabled():
            flat = [tensor for pair in leaves.values() for tensor in pair]
            grads = torch.autograd.grad(term, flat, retain_graph=True, allow_unused=True)
            for number, key in enumerate(leaves):
                pair = [grads[2 * number + side] if grads[2 * number + side] is not None
                        else torch.zeros_like(flat[2 * number + side]) for side in (0, 1)]
                state.pending[key] = [*pair, detached[key][2]]
        return {"balance": term if live else term.detach()}

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """The step's statistics are spent: drop any left (a forward whose loss was not taken)."""
        bank = moe_bank(model)
        if bank is not None:
            bank.state.records.clear()
            bank.state.pending.clear()
            fold_step_counts(bank)

    def after_training(self, context: TaskContext) -> None:
        """Activate-freeze (the task's most chosen experts per layer), then this task's DDAS autoencoder; the base
        parameters get their `requires_grad` flags back."""
        model = context.model
        bank = _bank(model)
        bank.state.records.clear()
        bank.state.pending.clear()
        fold_step_counts(bank)
        if self.config.freeze_top:
            for moe in bank.moe_layers.values():
                if int(moe.counts.sum()) == 0:
                    continue
                order = torch.argsort(moe.counts, descending=True, stable=True)[: self.config.freeze_top]
                moe.frozen[order.to(moe.frozen.device)] = True
        if self.config.ddas:
            self.train_selector(context, bank)
        for param in bank.parameters():
            param.requires_grad_(False)
        restore_flags(model, self._flags)
        _ignore_on_save(model)

    def train_selector(self, context: TaskContext, bank: MoEAdapterBank) -> None:
        """AE^t on the frozen image embeddings of the task's training images (every process the same), with its
        calibrated threshold."""
        embeddings = task_image_embeddings(context, self.config.ddas_max_examples)
        features = ddas_features(embeddings)
        autoencoder, errors = train_autoencoder(
            features, self.config.ddas_code_dim, self.config.ddas_steps, self.config.ddas_batch_size,
            self.config.ddas_lr, seed=context.seed)
        threshold = float(torch.quantile(errors, self.config.ddas_quantile)) * self.config.ddas_margin
        bank.add_autoencoder(autoencoder.to(dtype=bank.thresholds.dtype), threshold)
        logger.info("%s, task %d: DDAS autoencoder on %d images, reconstruction error %.4g (mean), threshold %.4g",
                    NAME, context.task_index, len(features), float(errors.mean()), threshold)

    # ----- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The bank's tensors (experts, routers, noise weights, autoencoders, thresholds, frozen sets), the
        per-layer choice counts of the task in progress, and the structure to rebuild it."""
        bank = self._bank
        if bank is None:
            return dict(self._state) if self._state is not None else {}
        feature_dim = bank.ddas_autoencoders[0].encoder_linear.in_features if len(bank.autoencoders) else None
        return {
            "bank": {key: tensor.detach().to("cpu", copy=True) for key, tensor in bank.state_dict().items()},
            "counts": {key: moe.counts.detach().to("cpu", copy=True) for key, moe in bank.moe_layers.items()},
            "num_routes": bank.num_routes,
            "num_autoencoders": len(bank.autoencoders),
            "feature_dim": feature_dim,
            "current_task": bank.state.current_task,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`: into the model's adapters when they are installed (a task resumed from a Trainer
        checkpoint), else at the next `on_task_start`."""
        if not state:
            return
        self._state = dict(state)
        if self._bank is not None:
            self._load_into(self._bank, state)

    def _load_into(self, bank: MoEAdapterBank, state: Mapping[str, Any]) -> None:
        if int(state["num_routes"]) < bank.num_routes:
            raise ValueError(f"{NAME}: a state with {state['num_routes']} routers cannot be loaded into adapters "
                             f"with {bank.num_routes}")
        feature_dim = state.get("feature_dim")
        bank.grow(int(state["num_routes"]), int(state["num_autoencoders"]), self.config.ddas_code_dim,
                  None if feature_dim is None else int(feature_dim))
        tensors = state["bank"]
        bank.thresholds = bank.thresholds.new_zeros(tensors["thresholds"].shape)
        bank.load_state_dict({key: value for key, value in tensors.items()}, strict=True)
        for key, counts in state.get("counts", {}).items():
            moe = bank.moe_layers[key]
            moe.counts = counts.to(device=moe.frozen.device, dtype=torch.int64).clone()
            moe.step_counts = torch.zeros_like(moe.counts)
        bank.state.current_task = int(state.get("current_task", 0))


# ----------------------------------------------------------------------------------------------------------------
# DDAS training
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def task_image_embeddings(
    context: TaskContext, max_examples: int | None = None,
    frozen: Callable[[nn.Module], contextlib.AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """Normalised image embeddings of the frozen model (route -1) of the task's own training images (its train
    split, without rows other methods add, e.g. replay): all of them, or a seeded subset of `max_examples` (the
    first `max_examples` of a stream). Float32 on the model's device; every process computes all of them.
    `frozen(model)`: the block in which the model is the frozen one (default: `use_routes(model, -1)`; DIKI passes
    its own)."""
    from ..data.streaming import is_streaming

    if context.collator is None or context.task is None:
        raise ValueError(f"{NAME} trains its DDAS autoencoder on the task's training images and needs the task and "
                         "context.collator (set by ContinualLearner)")
    model, dataset, collator = context.model, context.task.train, context.collator
    batch_size = max(int(context.eval_batch_size or 64), 1)
    if is_streaming(dataset):
        rows = iter(dataset if max_examples is None else dataset.take(max_examples))
        batches: Iterator[list[Any]] = iter(lambda: list(itertools.islice(rows, batch_size)), [])
    else:
        count = len(dataset)
        indices = list(range(count))
        if max_examples is not None and count > max_examples:
            generator = torch.Generator().manual_seed(int(context.seed))
            indices = sorted(torch.randperm(count, generator=generator)[:max_examples].tolist())
        batches = iter([dataset[int(i)] for i in indices[start : start + batch_size]]
                       for start in range(0, len(indices), batch_size))
    device = next(model.parameters()).device
    parts = []
    was_training = model.training
    model.eval()
    try:
        with use_routes(model, -1) if frozen is None else frozen(model):
            for batch in batches:
                inputs = model.image_inputs(collator(batch), device=device)
                parts.append(model.embed_images(**inputs).float())
    finally:
        model.train(was_training)
    if not parts:
        raise ValueError(f"{NAME}: the task has no training images for its DDAS autoencoder")
    return torch.cat(parts)


def train_autoencoder(
    features: torch.Tensor, code_dim: int = 100, steps: int = 300, batch_size: int = 64, lr: float = 0.01,
    seed: int = 0,
) -> tuple[AutoEncoder, torch.Tensor]:
    """A DDAS autoencoder trained on `features` [N, P] as the official chooser (Adam, weight decay 1e-4, MSE, lr x0.1
    every 10 epochs), seeded (init and batches); returns it (eval mode, frozen) and its errors on `features`."""
    features = features.detach().float()
    generator = torch.Generator().manual_seed(int(seed))
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init would draw from the global generator
        autoencoder = AutoEncoder(features.shape[1], code_dim, generator).to(features.device)
    optimizer = torch.optim.Adam(autoencoder.parameters(), lr=lr, weight_decay=DDAS_WEIGHT_DECAY)
    count = features.shape[0]
    per_epoch = max(math.ceil(count / batch_size), 1)
    order: list[int] = []
    with torch.enable_grad():
        for step in range(steps):
            if step % per_epoch == 0:
                order = torch.randperm(count, generator=generator).tolist()
            epoch = step // per_epoch
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.1 ** (epoch // DDAS_DECAY_EPOCHS)
            start = (step % per_epoch) * batch_size
            rows = torch.tensor(order[start : start + batch_size], device=features.device)
            batch = features[rows]
            loss = (autoencoder(batch) - batch).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    autoencoder.eval().requires_grad_(False)
    with torch.no_grad():
        errors = autoencoder.errors(features)
    return autoencoder, errors


# ----------------------------------------------------------------------------------------------------------------
# Inference from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def load_moe_model(name_or_path: str | Path, revision: str | None = None) -> ContinualDualEncoder:
    """A task checkpoint's model with its MoE adapters, routers and DDAS attached (from the method state beside
    it), in eval mode: what the run evaluated. `name_or_path`: a task folder (`output_dir/task-<k>/`) or a Hub
    repository id with its `revision` (`task-<k>`). The checkpoint's weights alone are the frozen base model."""
    method, model = load_checkpoint_method(MoEAdapters, name_or_path, revision)
    state = method._state or {}
    bank = install_moe_adapters(model, method.config)
    method._load_into(bank, state)
    for param in bank.parameters():
        param.requires_grad_(False)
    _ignore_on_save(model)
    return model.eval()
