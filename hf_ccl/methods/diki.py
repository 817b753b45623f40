"""DIKI (Tang et al., ECCV 2024, "Mind the Interference: Retaining Pre-trained Knowledge in Parameter Efficient
Continual Learning of Vision-Language Models", arXiv 2407.05342; official code lloongx/DIKI at 8ef89e7, cited below
as `DIKI.py`, `attention.py`, `model.py` and `configs/MTIL.yaml`).

**Where the facts come from.** The paper's text could not be read here (no copy of it is reachable from this
machine); its abstract and the official code could. Every formula below is the official code's, with its file and
line; where the code's choice is one of several natural readings, the other one is an option.

**Residual attention prompts (interference-free knowledge integration).** The base model is frozen. Each of the
first `depth` encoder layers (8 of ViT-B/16's 12, `prompt_depth_vision` / `prompt_depth_text: 8`) of each tower
(both towers by default) gets, per task t, a prompt of `prompt_length` (8, `n_ctx_*: 8`) keys P_K^t and values
P_V^t of the layer's width (`prefix_pool`, `attention.py` l. 167-173). With Q the layer's projected queries (before
the heads split) and A = softmax(Q K^T / sqrt(d_h)) V the layer's own attention output (per head, before `out_proj`):

    R^t = softmax(Q P_K^t^T / sqrt(d_h)) P_V^t                       per head, its own softmax over the prompts alone
    out = W_o (A + lambda R^t) + b_o = attn(x) + lambda W_o R^t       (`attention.py` l. 135-144)

The prompts are never concatenated to the layer's own keys (prefix tuning would renormalise the pre-trained
attention over them, the interference DIKI avoids): the prompt attention is a separate, fully residual path. P_V starts
at zero and P_K uniform in [-1, 1] (l. 171-172), so before training the model is exactly the pre-trained one. While
training, every sample takes the task's own prompt with lambda = 1 (`DIKI.py` l. 150-154: no calibration). The
prompt attention is not masked: on the causal text tower every token attends to every prompt, as in the code.
Installed with two forward hooks per layer (`q_proj`'s output is stashed; `self_attn`'s output gets
lambda W_o R^t), on the families whose layers have CLIP's `self_attn.q_proj` / `out_proj` (CLIP, SigLIP, SigLIP 2,
MetaCLIP 2). AltCLIP and Chinese-CLIP are refused (`unsupported_methods`): their text towers are BERT/XLM-R layers.

**Distribution-aware integration calibration.** After each task, the frozen model's normalised image embeddings f of
the task's training images give a Gaussian N(mu_t, Sigma_t): the mean and the unbiased covariance plus
`covariance_ridge` (1e-7) I (`DIKI.py` l. 325-335). At test time, for an image x:

    l_t(x) = log N(f(x); mu_t, Sigma_t)                                       (`DIKI.py` l. 150)
    t*(x) = argmax_t l_t(x)                                                    the task whose prompt it takes
    lambda(x) = sigmoid(l_{t*}(x) / s - c)                                     (l. 152-153: s = 512, c = 1)

The code's s = 512 is ViT-B/16's embedding width (the log-density of a P-dimensional Gaussian grows with P):
`calibration_scale: null` (the default) uses the model's own embedding width P, a number sets s (512: the code's
constant). `calibration_shift` is c. `calibration: false` injects with lambda = 1 (DIKI without its calibration).
An image far from every learned task gets lambda near 0: the pre-trained model's output. A task with fewer training
images than embedding dimensions has a singular covariance, which the tiny ridge leaves nearly so: images off its
span get very low likelihoods, hence lambda near 0 (the code's behaviour; `covariance_ridge` softens it). The class texts an image is
compared with are encoded with its route's prompt and the mean lambda of the images on that route (the code's
`text_batch_weight`, l. 154: the batch mean).

**Selection per image or per batch.** `selection: image` (default) routes each image to its own t*(x). The code
evaluates with `batchwise_prompt: True` (every config): one prompt per batch, the most frequent t* in it (l. 157-161),
each image still weighted by its own lambda(x): `selection: batch`, where hf_ccl's evaluator takes the task's whole
eval split as the batch.

**Evaluation.** hf_ccl's evaluator (`hf_ccl.evaluation.routing`) asks `DikiPrompts.evaluation_routes` for each eval
image's t* from the frozen embeddings it computed, then scores each route's images with that route's image embeddings
(each image's own lambda(x), computed inside the image tower from its frozen embedding: one frozen forward more per
image) and the route's class embeddings (the route's mean lambda): the protocol is unchanged. Results carry each
route's share (`route_<t>`). A forward outside the evaluator (`eval_routing: likelihood`, the default) routes and
weights images the same way and encodes texts with the current (last) task's prompt at lambda = 1; `current`: the
last task's prompt at lambda = 1 for images and texts; `frozen`: no prompts. `use_routes(model, routes, ...)` sets
routes and weights by hand.

**Checkpoints.** The prompts and Gaussians live in `model.diki` (a submodule) and in the method state (exact resume,
mid-task too); never in `model.safetensors`, whose weights are the unchanged base model (plain transformers loads
the model WITHOUT the prompts). `load_diki_model(task_folder)` (or `(repo_id, revision="task-<k>")`) gives the model
the run evaluated, as the model card's "How to use" says.

**Official training settings** (`configs/MTIL.yaml`): SGD, lr 5.0, cosine, 10 epochs, batch 128, weight decay 0,
cross-entropy over the task's class prompts; set them in the run's `training` (not part of the method).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

from ..modeling import ContinualDualEncoder
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .loading import CheckpointLoader
from .registry import register_method
from .state import load_checkpoint_method
from .trainable import requires_grad_flags, restore_flags

logger = logging.getLogger(__name__)

NAME = "diki"
#: The model attribute that holds the prompts and Gaussians (and the prefix of their parameter names).
BANK = "diki"
TOWER_LAYERS = {"text": "text_model.encoder.layers", "vision": "vision_model.encoder.layers"}
_TOWERS = tuple(TOWER_LAYERS)
REFUSED_FAMILIES = {
    "altclip": "its text tower is an XLM-R encoder whose attention (query/key/value, then output.dense) has no "
               "`self_attn.q_proj` / `out_proj` for the residual attention prompts",
    "chinese_clip": "its text tower is a BERT encoder whose attention (query/key/value, then output.dense) has no "
                    "`self_attn.q_proj` / `out_proj` for the residual attention prompts",
}
#: P_K ~ U(-KEY_INIT, KEY_INIT) (`attention.py` l. 172: `uniform_(prefix_pool[:, 0], -1, 1)`); P_V = 0.
KEY_INIT = 1.0
#: `use_routes(..., image_weights=CALIBRATED)`: each image's lambda(x) from its frozen embedding.
CALIBRATED = "calibrated"


def _refuse_families() -> None:
    from ..families import FAMILIES

    for family, reason in REFUSED_FAMILIES.items():
        cls = FAMILIES[family]
        cls.unsupported_methods = {**cls.unsupported_methods, NAME: reason}


_refuse_families()


# ----------------------------------------------------------------------------------------------------------------
# The equations
# ----------------------------------------------------------------------------------------------------------------
def residual_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_heads: int
                       ) -> torch.Tensor:
    """R = softmax(Q P_K^T / sqrt(d_h)) P_V per head (`attention.py` l. 138), [B, T, D] from queries [B, T, D] and
    prompt keys and values [B or 1, L, D] (the heads split D as the layer's own attention does)."""
    batch, length, width = queries.shape
    head = width // num_heads

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], num_heads, head).transpose(1, 2)

    keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    if keys.shape[0] != batch:
        keys, values = keys.expand(batch, -1, -1), values.expand(batch, -1, -1)
    out = nn.functional.scaled_dot_product_attention(heads(queries), heads(keys), heads(values))
    return out.transpose(1, 2).reshape(batch, length, width)


def task_statistics(features: torch.Tensor, ridge: float = 1e-7) -> tuple[torch.Tensor, torch.Tensor]:
    """(mu, Sigma) of features [N, P] in float32: the mean and the unbiased covariance plus `ridge` I
    (`DIKI.py` l. 330-333)."""
    features = features.detach().float()
    if features.shape[0] < 2:
        raise ValueError(f"{NAME}: a task's Gaussian needs at least 2 training images, got {features.shape[0]}")
    mean = features.mean(0)
    delta = features - mean
    covariance = delta.T @ delta / (features.shape[0] - 1)
    return mean, covariance + ridge * torch.eye(features.shape[1], device=features.device)


def log_likelihoods(features: torch.Tensor, means: torch.Tensor, covariances: torch.Tensor) -> torch.Tensor:
    """l_t(x) = log N(f(x); mu_t, Sigma_t) [N, T] of normalised frozen embeddings [N, P] under each task's Gaussian
    (`DIKI.py` l. 149-150, `MultivariateNormal.log_prob`), computed in float64 through a Cholesky factor."""
    x = features.double()
    out = []
    for mean, covariance in zip(means.double(), covariances.double(), strict=True):
        factor, info = torch.linalg.cholesky_ex(covariance)
        if int(info):
            raise ValueError(f"{NAME}: a task's covariance is not positive definite: raise method_args.{NAME}."
                             "covariance_ridge")
        solved = torch.linalg.solve_triangular(factor, (x - mean).T, upper=False)  # L^-1 (x - mu)
        log_det = 2 * factor.diagonal().log().sum()
        out.append(-0.5 * (solved.pow(2).sum(0) + log_det + x.shape[1] * math.log(2 * math.pi)))
    return torch.stack(out, dim=1)


def calibration_weights(best: torch.Tensor, scale: float, shift: float) -> torch.Tensor:
    """lambda = sigmoid(l_{t*} / s - c) of the best log-likelihoods [N] (`DIKI.py` l. 152-153, s = 512, c = 1)."""
    return torch.sigmoid(best / scale - shift)


def select_tasks(likelihoods: torch.Tensor, selection: str) -> torch.Tensor:
    """t*: argmax_t l_t(x) per image [N] (`selection: image`), or the most frequent of those for all (`batch`,
    `DIKI.py` l. 157-161; ties to the lowest task, as `torch.topk` of the sorted counts)."""
    best = likelihoods.argmax(dim=1)
    if selection == "batch":
        counts = torch.bincount(best, minlength=likelihoods.shape[1])
        best = torch.full_like(best, int(counts.argmax()))
    return best


# ----------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------
class RoutingState:
    """What the forwards of one model take, shared by its layers: routes (`DEFAULT`, an int, or a LongTensor per
    sample), the images' weights (`CALIBRATED`, a number or a tensor per sample) and the texts' weight."""

    DEFAULT = "default"

    def __init__(self, eval_routing: str) -> None:
        self.routes: str | int | torch.Tensor = self.DEFAULT
        self.image_weights: str | float | torch.Tensor = 1.0
        self.text_weight: float = 1.0
        self.current_task = 0
        self.eval_routing = eval_routing
        #: The image tower's per-sample routes and weights of its forward in progress (set by its pre-hook).
        self.tower_routes: torch.Tensor | None = None
        self.tower_weights: torch.Tensor | None = None
        self.selecting = False

    def resolve(self, tower: str, training: bool) -> tuple[int | torch.Tensor, float | torch.Tensor]:
        """(route, lambda) of a forward through `tower`."""
        routes = self.routes
        if isinstance(routes, str):
            if training:
                return self.current_task, 1.0
            if self.eval_routing == "frozen":
                return -1, 1.0
            if tower == "vision" and self.tower_routes is not None:
                return self.tower_routes, self.tower_weights if self.tower_weights is not None else 1.0
            return self.current_task, 1.0
        if tower == "text":
            return routes, self.text_weight
        weights = self.image_weights
        if isinstance(weights, str):
            weights = self.tower_weights if self.tower_weights is not None else 1.0
        return routes, weights

    def describe(self) -> str:
        def shown(value: Any) -> Any:
            return value.tolist() if isinstance(value, torch.Tensor) else value

        return (f"routes={shown(self.routes)}, image_weights={shown(self.image_weights)}, text_weight="
                f"{self.text_weight}, current_task={self.current_task}, eval_routing={self.eval_routing}")


class ResidualPrompts(nn.Module):
    """The per-task prompts (P_K, P_V) of one attention layer, `prompts[t]` of shape [2, L, D], run by two hooks:
    `stash_queries` (on `q_proj`) and `add_residual` (on `self_attn`: its output plus lambda W_o R^t)."""

    def __init__(self, key: str, tower: str, attention: nn.Module, length: int, state: RoutingState):
        super().__init__()
        q_proj = cast(nn.Linear, attention.get_submodule("q_proj"))
        self.key, self.tower, self.length = key, tower, length
        self.dim, self.num_heads = q_proj.out_features, int(cast(int, attention.num_heads))
        self.prompts = nn.ParameterList()
        self.state = state
        self._queries: torch.Tensor | None = None
        self._reference = (q_proj.weight,)  # where new prompts go (a tuple: not a submodule or parameter of ours)

    def add_prompt(self, generator: torch.Generator | None = None) -> None:
        """Task t's prompt: keys U(-1, 1), values 0 (`attention.py` l. 171-172)."""
        prompt = torch.zeros(2, self.length, self.dim)
        prompt[0].uniform_(-KEY_INIT, KEY_INIT, generator=generator)
        reference = self._reference[0]
        self.prompts.append(nn.Parameter(prompt.to(device=reference.device, dtype=reference.dtype)))

    def stash_queries(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        self._queries = output

    def add_residual(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        queries, self._queries = self._queries, None
        if queries is None:
            raise RuntimeError(f"{NAME} {self.key}: the attention ran without its q_proj")
        route, weight = self.state.resolve(self.tower, self.training)
        if isinstance(route, int):
            if route < 0 or not len(self.prompts):
                return output
            prompt = self.prompts[route]
            keys, values = prompt[0][None], prompt[1][None]
            active: torch.Tensor | None = None
        else:
            route = route.to(queries.device)
            if route.shape[0] != queries.shape[0]:
                raise ValueError(f"{NAME}: {route.shape[0]} routes for a batch of {queries.shape[0]} samples")
            stacked = torch.stack(list(self.prompts))[route.clamp(min=0)]
            keys, values = stacked[:, 0], stacked[:, 1]
            active = route >= 0
        attention = output[0] if isinstance(output, tuple) else output
        residual = residual_attention(queries, keys, values, self.num_heads)
        if isinstance(weight, torch.Tensor):
            scale = weight.to(device=residual.device, dtype=residual.dtype)
            if active is not None:
                scale = torch.where(active, scale, torch.zeros_like(scale))
            residual = residual * scale[:, None, None]
        else:
            if active is not None:
                residual = residual * active.to(residual.dtype)[:, None, None]
            if weight != 1.0:
                residual = residual * weight
        out_proj = cast(nn.Linear, module.get_submodule("out_proj"))
        injected = nn.functional.linear(residual, out_proj.weight).to(attention.dtype)
        attention = attention + injected
        return (attention, *output[1:]) if isinstance(output, tuple) else attention


class DikiPrompts(nn.Module):
    """Everything DIKI adds to a model, as `model.diki`: a `ResidualPrompts` per prompted layer
    (`layers["<tower>_<index>"]`), the tasks' Gaussians (`means` [T, P], `covariances` [T, P, P]) and the routing
    state. Implements `hf_ccl.evaluation.routing.EvaluationRouter`."""

    def __init__(self, config: DikiConfig):
        super().__init__()
        self.config = config
        self.state = RoutingState(config.eval_routing)
        self.layers = nn.ModuleDict()
        self.means: torch.Tensor
        self.covariances: torch.Tensor
        self.register_buffer("means", torch.zeros(0, 0))
        self.register_buffer("covariances", torch.zeros(0, 0, 0))
        #: Per route: the mean lambda of the eval images `evaluation_routes` sent to it (its texts' weight).
        self.route_text_weights: dict[int, float] = {}
        self._image_projection: tuple[nn.Module | None, ...] = (None,)

    @property
    def prompt_layers(self) -> dict[str, ResidualPrompts]:
        return cast("dict[str, ResidualPrompts]", dict(self.layers.items()))

    @property
    def num_prompts(self) -> int:
        """How many tasks' prompts each layer has."""
        return len(next(iter(self.prompt_layers.values())).prompts) if len(self.layers) else 0

    @property
    def num_statistics(self) -> int:
        """How many tasks' Gaussians are stored."""
        return int(self.means.shape[0])

    @property
    def _active_adapter(self) -> str:
        """The routing state, under the name `hf_ccl.evaluation.fingerprint` reads as an adapter switch."""
        return self.state.describe()

    # ----- Gaussians and calibration ----------------------------------------------------------------------------
    def add_statistics(self, mean: torch.Tensor, covariance: torch.Tensor) -> None:
        means = self.means if self.num_statistics else self.means.new_zeros(0, mean.shape[0])
        covariances = (self.covariances if self.num_statistics
                       else self.covariances.new_zeros(0, mean.shape[0], mean.shape[0]))
        self.means = torch.cat([means, mean[None].to(means)])
        self.covariances = torch.cat([covariances, covariance[None].to(covariances)])

    def likelihoods(self, embeddings: torch.Tensor) -> torch.Tensor:
        """l_t(x) [N, T] of normalised frozen embeddings."""
        if not self.num_statistics:
            raise ValueError(f"{NAME} has no task Gaussian yet: one is fitted after each task")
        return log_likelihoods(embeddings.to(self.means.device), self.means, self.covariances)

    def weights(self, likelihoods: torch.Tensor) -> torch.Tensor:
        """lambda(x) [N] from l_t(x) [N, T] (1 with `calibration: false`)."""
        best = likelihoods.max(dim=1).values
        if not self.config.calibration:
            return torch.ones_like(best).float()
        scale = self.config.calibration_scale or float(self.means.shape[1])
        return calibration_weights(best, scale, self.config.calibration_shift).float()

    # ----- the evaluator's routing (hf_ccl.evaluation.routing.EvaluationRouter) ------------------------------
    def evaluation_routes(self, frozen_image_embeds: torch.Tensor) -> torch.Tensor | None:
        """t* of every eval image (`eval_routing: likelihood` and at least one Gaussian; else None), keeping each
        route's mean lambda for its class texts."""
        if self.state.eval_routing != "likelihood" or not self.num_statistics or not self.num_prompts:
            return None
        likelihoods = self.likelihoods(frozen_image_embeds)
        routes = select_tasks(likelihoods, self.config.selection)
        weights = self.weights(likelihoods)
        self.route_text_weights = {int(route): float(weights[routes == route].mean())
                                   for route in torch.unique(routes).tolist()}
        return routes

    def evaluation_route(self, model: nn.Module, route: int) -> contextlib.AbstractContextManager[None]:
        """Every forward inside takes `route` (-1: no prompts): images with their own lambda(x), texts with the
        route's mean lambda of the last `evaluation_routes`."""
        if route < 0:
            return use_routes(model, -1)
        return use_routes(model, route, image_weights=CALIBRATED if self.config.calibration else 1.0,
                          text_weight=self.route_text_weights.get(route, 1.0) if self.config.calibration else 1.0)

    # ----- the image tower's hook: routes and lambda(x) from the frozen embedding -----------------------------
    def tower_pre_hook(self, vision_model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self.state
        default = isinstance(state.routes, str)
        wants = (default and state.eval_routing == "likelihood") or (
            not default and isinstance(state.image_weights, str))
        if self.training or state.selecting or not wants or not self.num_statistics:
            return
        state.selecting = True
        previous, state.routes = state.routes, -1
        try:
            with torch.no_grad():
                outputs = vision_model(*args, **kwargs)
                pooled = outputs.pooler_output if hasattr(outputs, "pooler_output") else outputs[1]
                projection = self._image_projection[0]
                embeddings = projection(pooled) if projection is not None else pooled
                likelihoods = self.likelihoods(nn.functional.normalize(embeddings.float(), dim=-1))
        finally:
            state.routes, state.selecting = previous, False
        state.tower_weights = self.weights(likelihoods)
        state.tower_routes = select_tasks(likelihoods, self.config.selection) if default else None

    def tower_post_hook(self, vision_model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.state.selecting:
            self.state.tower_routes = self.state.tower_weights = None

    # ----- structure ----------------------------------------------------------------------------------------
    def grow(self, num_prompts: int, generator: torch.Generator | None = None) -> None:
        """Add prompts (every layer the same count) up to `num_prompts`."""
        for layer in self.prompt_layers.values():
            while len(layer.prompts) < num_prompts:
                layer.add_prompt(generator)


# ----------------------------------------------------------------------------------------------------------------
# The routing API
# ----------------------------------------------------------------------------------------------------------------
def diki_prompts(model: nn.Module) -> DikiPrompts | None:
    """The model's `DikiPrompts`, or None."""
    bank = getattr(model, BANK, None)
    return bank if isinstance(bank, DikiPrompts) else None


def _bank(model: nn.Module) -> DikiPrompts:
    bank = diki_prompts(model)
    if bank is None or bank.num_prompts == 0:
        raise ValueError(f"the model has no DIKI prompts ({type(model).__name__}.{BANK}): train it with the '{NAME}' "
                         "method or load it with load_diki_model")
    return bank


@contextlib.contextmanager
def use_routes(model: nn.Module, routes: int | torch.Tensor, image_weights: str | float | torch.Tensor = 1.0,
               text_weight: float = 1.0) -> Iterator[None]:
    """Inside the block every forward of `model` takes `routes`: a task's prompts (or -1: none, exactly the frozen
    model) for every sample, or a LongTensor [B] per sample; images are weighted by `image_weights` (a number, a
    tensor [B], or `CALIBRATED`: each image's lambda(x)), texts by `text_weight`. Blocks nest."""
    bank = _bank(model)
    count = bank.num_prompts
    if isinstance(routes, torch.Tensor):
        if routes.dim() != 1 or routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise ValueError(f"use_routes: per-sample routes must be a 1-D integer tensor, got {routes.dtype}")
        if routes.numel() and (int(routes.min()) < -1 or int(routes.max()) >= count):
            raise ValueError(f"use_routes: routes must be in [-1, {count - 1}], got {routes.tolist()}")
        value: int | torch.Tensor = routes.long()
    elif isinstance(routes, int) and not isinstance(routes, bool):
        if not -1 <= routes < count:
            raise ValueError(f"use_routes: route {routes} is not -1 or a trained task's prompt (0..{count - 1})")
        value = routes
    else:
        raise TypeError(f"use_routes: routes must be an int or a LongTensor, got {type(routes).__name__}")
    if isinstance(image_weights, str) and image_weights != CALIBRATED:
        raise ValueError(f"use_routes: image_weights must be a number, a tensor or {CALIBRATED!r}")
    state = bank.state
    previous = state.routes, state.image_weights, state.text_weight
    state.routes, state.image_weights, state.text_weight = value, image_weights, float(text_weight)
    try:
        yield
    finally:
        state.routes, state.image_weights, state.text_weight = previous


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class DikiConfig(MethodConfig):
    prompt_length: int = field(default=8, metadata={"help": "Keys and values per prompt (n_ctx_vision/text: 8)."})
    depth: int = field(
        default=8, metadata={"help": "Prompts go into the first `depth` encoder layers of each tower (prompt_depth_"
                                     "vision/text: 8 of ViT-B/16's 12); a tower with fewer layers gets all of them."})
    towers: list[str] = field(
        default_factory=lambda: ["text", "vision"],
        metadata={"help": "Towers whose layers get prompts (the code: both)."})
    calibration: bool = field(
        default=True, metadata={"help": "Scale the injection of each image by lambda(x) = sigmoid(l/s - c) of its "
                                        "best task log-likelihood l; false: lambda = 1 (no calibration)."})
    calibration_scale: float | None = field(
        default=None, metadata={"help": "s of lambda; null: the model's embedding width (the code's 512 is "
                                        "ViT-B/16's); 512: the code's constant."})
    calibration_shift: float = field(default=1.0, metadata={"help": "c of lambda (the code: 1.0)."})
    selection: Literal["image", "batch"] = field(
        default="image",
        metadata={"help": "'image': each image takes its most likely task's prompt; 'batch': the most frequent of "
                          "those for the whole batch (the code's batchwise_prompt; the evaluator's batch is the "
                          "task's eval split)."})
    eval_routing: Literal["likelihood", "current", "frozen"] = field(
        default="likelihood",
        metadata={"help": "'likelihood': images by their Gaussian likelihood with lambda(x) (the evaluator pairs "
                          "each route's texts with it); 'current': the last task's prompts at lambda = 1; "
                          "'frozen': no prompts."})
    covariance_ridge: float = field(default=1e-7, metadata={"help": "Added to each Gaussian's covariance diagonal "
                                                                     "(the code's 1e-7)."})
    statistics_max_examples: int | None = field(
        default=None, metadata={"help": "Fit each task's Gaussian on at most this many of its training images (a "
                                        "seeded subset); null: all (the code)."})

    def __post_init__(self) -> None:
        check_range("prompt_length", self.prompt_length, 1)
        check_range("depth", self.depth, 1)
        if not self.towers or any(tower not in _TOWERS for tower in self.towers) or \
                len(set(self.towers)) != len(self.towers):
            raise ConfigError(f"towers must be a non-empty list of distinct towers among {list(_TOWERS)}, got "
                              f"{self.towers}", "towers")
        check_range("calibration_scale", self.calibration_scale, 0.0, low_open=True, also="or null")
        if not math.isfinite(self.calibration_shift):
            raise ConfigError(f"calibration_shift must be finite, got {self.calibration_shift}", "calibration_shift")
        if self.selection not in ("image", "batch"):
            raise ConfigError(f"selection must be 'image' or 'batch', got {self.selection!r}", "selection")
        if self.eval_routing not in ("likelihood", "current", "frozen"):
            raise ConfigError(f"eval_routing must be 'likelihood', 'current' or 'frozen', got {self.eval_routing!r}",
                              "eval_routing")
        check_range("covariance_ridge", self.covariance_ridge, 0.0, low_open=True)
        check_range("statistics_max_examples", self.statistics_max_examples, 2, also="or null")


def prompted_layers(model: nn.Module, config: DikiConfig) -> dict[str, list[nn.Module]]:
    """The attention modules (`self_attn` with `q_proj` and `out_proj`) of the first `depth` layers of each tower."""
    family = getattr(model, "family", type(model).__name__)
    found = {}
    for tower in config.towers:
        try:
            layers = model.get_submodule(TOWER_LAYERS[tower])
        except AttributeError:
            layers = None
        attentions = [getattr(layer, "self_attn", None) for layer in layers] if isinstance(layers, nn.ModuleList) \
            else []
        if not attentions or not all(isinstance(getattr(a, "q_proj", None), nn.Linear) and
                                     isinstance(getattr(a, "out_proj", None), nn.Linear) and
                                     isinstance(getattr(a, "num_heads", None), int) for a in attentions):
            raise ValueError(f"{NAME}: the {family} {tower} tower has no CLIP-style attention layers "
                             f"({TOWER_LAYERS[tower]}.<i>.self_attn.q_proj and .out_proj) for the residual prompts")
        found[tower] = cast("list[nn.Module]", attentions[: config.depth])
    return found


def install_diki(model: nn.Module, config: DikiConfig) -> DikiPrompts:
    """Add an empty `DikiPrompts` to `model` as `model.diki`, hooked into the prompted layers; kept out of
    `save_pretrained`."""
    if diki_prompts(model) is not None:
        raise ValueError(f"the model already has DIKI prompts ({BANK})")
    bank = DikiPrompts(config)
    reference: nn.Linear | None = None
    for tower, attentions in prompted_layers(model, config).items():
        for index, attention in enumerate(attentions):
            q_proj = cast(nn.Linear, attention.get_submodule("q_proj"))
            reference = reference or q_proj
            layer = ResidualPrompts(f"{tower}_{index}", tower, attention, config.prompt_length, bank.state)
            bank.layers[layer.key] = layer
            q_proj.register_forward_hook(layer.stash_queries)
            attention.register_forward_hook(layer.add_residual)
    vision = getattr(model, "vision_model", None)
    if vision is not None:
        bank._image_projection = (model.projection("image") if isinstance(model, ContinualDualEncoder) else None,)
        vision.register_forward_pre_hook(bank.tower_pre_hook, with_kwargs=True)
        vision.register_forward_hook(bank.tower_post_hook)
    if reference is not None:
        bank.to(device=reference.weight.device)
    setattr(model, BANK, bank)
    _ignore_on_save(model)
    return bank


def _ignore_on_save(model: nn.Module) -> None:
    """Keep every `diki.` key out of `save_pretrained` (transformers' `_keys_to_ignore_on_save`)."""
    bank = diki_prompts(model)
    ignored = {key for key in (getattr(model, "_keys_to_ignore_on_save", None) or ()) if not key.startswith(BANK + ".")}
    if bank is not None:
        ignored |= {f"{BANK}.{key}" for key in bank.state_dict()}
    setattr(model, "_keys_to_ignore_on_save", ignored)  # noqa: B010


@register_method
class Diki(ContinualMethod[DikiConfig]):
    """Residual attention prompts per task with distribution-aware calibration (see the module docstring)."""

    fsdp_refusal = ("its prompts and Gaussians are modules attached to the model, which the plain model the loop "
                    "gathers after each task would not carry")
    name = NAME
    config_class = DikiConfig
    test_options = {"prompt_length": 2, "depth": 1}
    test_families = ("siglip",)
    roles = {
        "previous_model": "adds a prompt per task to the previous task's model",
        "parameter_efficient": "freezes the model but for the current task's prompts",
    }
    conflicts = {"parameter_efficient": "freezes the model but for its prompts: each would freeze the other's "
                 "parameters"}
    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_diki_model",
        keeps="its residual attention prompts per task and the tasks' Gaussians (calibration)",
        plain_model="the base model without the prompts (DIKI's frozen model)")

    def __init__(self, config: DikiConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self._state: dict[str, Any] | None = None  # a loaded state not yet installed into a model
        self._bank: DikiPrompts | None = None
        self._flags: dict[str, bool] = {}

    def check_model(self, model: nn.Module) -> None:
        try:
            prompted_layers(model, self.config)
        except ValueError as error:
            raise ConfigError(str(error), "methods") from None

    def on_task_start(self, context: TaskContext) -> None:
        """Install the prompts (first task, or the first after a resume, from the method state), add this task's
        prompt, and freeze everything but it."""
        model = context.model
        bank = diki_prompts(model)
        if bank is None:
            self.check_model(model)
            self._flags = requires_grad_flags(model)
            bank = install_diki(model, self.config)
        else:
            self._flags = {name: flag for name, flag in requires_grad_flags(model).items()
                           if not name.startswith(BANK + ".")}
        if self._state is not None and bank is not self._bank:
            self._load_into(bank, self._state)
        self._bank, self._state = bank, None
        index = context.task_index
        if bank.num_prompts > index + 1:
            raise ValueError(f"{NAME}: the model has prompts for {bank.num_prompts} tasks at the start of task {index}")
        generator = torch.Generator().manual_seed(int(context.seed) + index)
        bank.grow(index + 1, generator)
        bank.state.current_task = index
        _ignore_on_save(model)
        model.requires_grad_(False)
        for layer in bank.prompt_layers.values():
            layer.prompts[index].requires_grad_(True)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info("%s, task %d: %d trainable parameters (prompts in %d layers)", NAME, index, trainable,
                    len(bank.layers))

    def after_training(self, context: TaskContext) -> None:
        """The task's Gaussian of the frozen image embeddings of its training images; the base parameters get their
        `requires_grad` flags back."""
        from .moe_adapters import task_image_embeddings

        model = context.model
        bank = _bank(model)
        if bank.num_statistics <= context.task_index:
            if context.collator is None or context.task is None:
                raise ValueError(f"{NAME} fits a Gaussian on the task's training images and needs the task and "
                                 "context.collator (set by ContinualLearner)")
            embeddings = task_image_embeddings(context, self.config.statistics_max_examples,
                                               frozen=lambda m: use_routes(m, -1))
            mean, covariance = task_statistics(embeddings, self.config.covariance_ridge)
            bank.add_statistics(mean, covariance)
            logger.info("%s, task %d: Gaussian of %d frozen image embeddings", NAME, context.task_index,
                        embeddings.shape[0])
        for param in bank.parameters():
            param.requires_grad_(False)
        restore_flags(model, self._flags)
        _ignore_on_save(model)

    # ----- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The prompts of every task (the one in training too), the Gaussians, and the structure to rebuild them."""
        bank = self._bank
        if bank is None:
            return dict(self._state) if self._state is not None else {}
        return {
            "bank": {key: tensor.detach().to("cpu", copy=True) for key, tensor in bank.state_dict().items()},
            "num_prompts": bank.num_prompts,
            "current_task": bank.state.current_task,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`: into the model's prompts when installed (a task resumed mid-way), else at the next
        `on_task_start`."""
        if not state:
            return
        self._state = dict(state)
        if self._bank is not None:
            self._load_into(self._bank, state)

    def _load_into(self, bank: DikiPrompts, state: Mapping[str, Any]) -> None:
        if int(state["num_prompts"]) < bank.num_prompts:
            raise ValueError(f"{NAME}: a state with {state['num_prompts']} prompts cannot be loaded into a model with "
                             f"{bank.num_prompts}")
        with torch.random.fork_rng(devices=[]):
            bank.grow(int(state["num_prompts"]))  # overwritten below
        tensors = state["bank"]
        bank.means = bank.means.new_zeros(tensors["means"].shape)
        bank.covariances = bank.covariances.new_zeros(tensors["covariances"].shape)
        bank.load_state_dict(dict(tensors), strict=True)
        bank.state.current_task = int(state.get("current_task", 0))


# ----------------------------------------------------------------------------------------------------------------
# Inference from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def load_diki_model(name_or_path: str | Path, revision: str | None = None) -> ContinualDualEncoder:
    """A task checkpoint's model with its DIKI prompts and Gaussians attached (from the method state beside it), in
    eval mode: what the run evaluated. `name_or_path`: a task folder or a Hub repository id with its `revision`
    (`task-<k>`). The checkpoint's weights alone are the frozen base model."""
    method, model = load_checkpoint_method(Diki, name_or_path, revision)
    bank = install_diki(model, method.config)
    method._load_into(bank, method._state or {})
    for param in bank.parameters():
        param.requires_grad_(False)
    _ignore_on_save(model)
    return model.eval()
