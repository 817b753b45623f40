"""The quadratic-penalty machinery shared by EWC, SI and MAS: anchors, importances, penalty, importance pass.

Each of these methods adds one loss term, logged as `loss/<method>/penalty`:

    P(θ) = s · Σ_i Ω_i (θ_i − θ*_i)²,

θ* being the parameters at the end of the previous task (the anchor), Ω a per-parameter importance and s the
method's coefficient: λ/2 for EWC (Kirkpatrick et al. 2017, Eq. 3), c for SI (Zenke et al. 2017, Eq. 4) and
λ for MAS (Aljundi et al. 2018, Eq. 3). The methods differ only in how they estimate Ω.

Parameters: every trainable one (`requires_grad`) at the time the importance is estimated, less the token
embedding with `exclude_token_embedding` (with CLIP's 49,408-token vocabulary it holds most of a small model's
parameters) and less the names that match `exclude_parameters` (fnmatch patterns). When a parameter grows along
dim 0 (`resize_token_embeddings`), its old rows keep their importance and the new rows get 0 (as CLL-CLIP's oEWC).

Speed: the dense part of the penalty is one custom autograd function over `torch._foreach_*` kernels. Its forward
computes θ − θ*, Ω ⊙ (θ − θ*) and one dot product per tensor; its backward is one fused multiply,
2 Ω ⊙ (θ − θ*). The token embedding is penalised only on its rows with nonzero importance (a task touches few
tokens), and its gradient is a sparse row gradient (`sparse_token_rows`).

Importance data (EWC, MAS): `on_task_end` reads `context.collator` (a `CLIPCollator` in eval mode) and
`context.train_dataset` (the dataset the task trained on). Every process plans the same batches (a
seeded subset cut into fixed batches), and the batches are dealt to processes round-robin. Each process sums its
statistic without any collective call; the sums and counts are then reduced with `all_reduce_sum_`. The estimate
therefore does not depend on the number of processes, and every process ends with the same importances.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..class_prompts import class_prompt_loss
from ..distributed import all_reduce_sum_, rank, world_size
from ..losses import positive_mask
from .base import ContinualMethod, MethodConfig, TaskContext

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

PENALTY_TERM = "penalty"
COLLATOR_KEY = "collator"
DATASET_KEY = "train_dataset"
ACCUMULATION_RULES = ("sum", "average")


# ----- configuration ----------------------------------------------------------------------------------------------
@dataclass
class QuadraticPenaltyConfig(MethodConfig):
    """Options every quadratic-penalty method shares: which parameters the penalty covers."""

    exclude_token_embedding: bool = field(
        default=False,
        metadata={
            "help": "Leave the text token embedding out of the penalty (most of a tiny CLIP's parameters)."
        },
    )
    exclude_parameters: list[str] = field(
        default_factory=list,
        metadata={"help": "fnmatch patterns of parameter names to leave out, e.g. ['vision_model.*']."},
    )
    sparse_token_rows: bool = field(
        default=True,
        metadata={
            "help": "Penalise the token embedding on its rows with nonzero importance only, through a sparse row "
            "gradient (fast); False: dense, for FSDP/DeepSpeed, which take no sparse gradients."
        },
    )

    def __post_init__(self) -> None:
        self.exclude_parameters = [str(pattern) for pattern in self.exclude_parameters]


def check_accumulation(rule: str, gamma: float = 1.0) -> None:
    """Validate an importance accumulation rule (see `accumulate_importance`)."""
    if rule not in ACCUMULATION_RULES:
        raise ValueError(f"accumulate must be one of {list(ACCUMULATION_RULES)}, got {rule!r}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if rule == "average" and gamma != 1.0:
        raise ValueError("gamma applies to accumulate='sum' only; leave it at 1.0 with accumulate='average'")


# ----- parameter selection and shapes -----------------------------------------------------------------------------
def token_embedding_name(model: nn.Module) -> str | None:
    """The name of the input (token) embedding weight, or None when the model has none."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    weight = getattr(embedding, "weight", None)
    if weight is None:
        return None
    return next((name for name, param in model.named_parameters() if param is weight), None)


def select_parameters(
    model: nn.Module, exclude_token_embedding: bool = False, exclude: Sequence[str] = ()
) -> dict[str, nn.Parameter]:
    """The trainable parameters the penalty covers, by name, in `named_parameters` order."""
    skipped = {token_embedding_name(model)} if exclude_token_embedding else set()
    return {
        name: param
        for name, param in model.named_parameters()
        if param.requires_grad and name not in skipped and not any(fnmatch.fnmatch(name, p) for p in exclude)
    }


def fit_rows(stored: torch.Tensor, like: torch.Tensor, fill: torch.Tensor | None, name: str) -> torch.Tensor:
    """`stored` on `like`'s device and dtype; rows added along dim 0 since (vocabulary growth) are taken from
    `fill` (zeros when None). Any other shape change is an error naming the parameter."""
    stored = stored.to(device=like.device, dtype=like.dtype)
    if stored.shape == like.shape:
        return stored
    if stored.dim() == like.dim() and stored.shape[1:] == like.shape[1:] and stored.shape[0] < like.shape[0]:
        extra = (
            torch.zeros_like(like[stored.shape[0] :]) if fill is None else fill[stored.shape[0] :].detach()
        )
        return torch.cat([stored, extra.to(stored.dtype)], dim=0)
    raise ValueError(
        f"Parameter {name!r} has shape {tuple(like.shape)} but its stored penalty state has {tuple(stored.shape)}; "
        "only growth along dim 0 (new token rows) is supported"
    )


def accumulate_importance(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    rule: str = "sum",
    gamma: float = 1.0,
    tasks_before: int = 0,
) -> dict[str, torch.Tensor]:
    """Merge this task's importance into the running one.

    - `sum`: Ω ← γ Ω + Ω_t (online EWC, Schwarz et al. 2018; γ = 1 is the plain sum of MAS, Aljundi et al. 2018).
    - `average`: Ω ← α Ω + (1 − α) Ω_t with α = t/(t+1), t = `tasks_before` (the CTP code's running mean).

    A parameter missing on one side counts as importance 0 there; grown rows are padded with 0.
    """
    merged: dict[str, torch.Tensor] = {}
    alpha = tasks_before / (tasks_before + 1)
    for name in {**old, **new}:
        current = new.get(name)
        previous = old.get(name)
        if current is None:
            assert previous is not None  # the name is in one of the two
            previous = previous.detach()
            merged[name] = gamma * previous if rule == "sum" else alpha * previous
            continue
        previous = torch.zeros_like(current) if previous is None else fit_rows(previous, current, None, name)
        merged[name] = (
            gamma * previous + current if rule == "sum" else alpha * previous + (1 - alpha) * current
        )
    return merged


# ----- the penalty ------------------------------------------------------------------------------------------------
class _WeightedSquares(torch.autograd.Function):
    """Σ_i Σ_j Ω_ij (θ_ij − θ*_ij)² over lists of tensors; backward 2 Ω (θ − θ*) (multi-tensor kernels)."""

    @staticmethod
    def forward(
        ctx: Any, anchors: list[torch.Tensor], importances: list[torch.Tensor], *params: torch.Tensor
    ):
        diffs = torch._foreach_sub(list(params), anchors)
        weighted = torch._foreach_mul(diffs, importances)
        ctx.weighted = weighted
        return torch.stack(
            [torch.dot(d.reshape(-1), w.reshape(-1)) for d, w in zip(diffs, weighted, strict=True)]
        ).sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        weighted = ctx.weighted
        del ctx.weighted
        grads = torch._foreach_mul(weighted, 2.0 * grad_output)
        needs = ctx.needs_input_grad[2:]
        return None, None, *(g if need else None for g, need in zip(grads, needs, strict=True))


def weighted_squares(
    params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor], importances: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Σ Ω (θ − θ*)² summed over every tensor (differentiable in `params`)."""
    return _WeightedSquares.apply(list(anchors), list(importances), *params)


@dataclass
class _RowEntry:
    """The penalty on the rows of a parameter that have any importance (the token embedding)."""

    param: torch.Tensor
    rows: torch.Tensor
    anchor: torch.Tensor
    importance: torch.Tensor

    def value(self) -> torch.Tensor:
        """Σ Ω (θ − θ*)² over the rows; the gradient reaches the parameter as a sparse (row) gradient."""
        current = nn.functional.embedding(self.rows, self.param, sparse=True)
        return (self.importance * (current - self.anchor).pow(2)).sum()


@dataclass
class _Aligned:
    """The penalty's operands on the parameters' devices: dense tensors and row-compacted ones; under FSDP2, each
    process's shards of the parameters FSDP2 holds as shards, and of their anchors and importances."""

    key: tuple
    params: list[torch.Tensor]
    anchors: list[torch.Tensor]
    importances: list[torch.Tensor]
    rows: list[_RowEntry]
    shards: list[DTensor] = field(default_factory=list)
    shard_anchors: list[torch.Tensor] = field(default_factory=list)
    shard_importances: list[torch.Tensor] = field(default_factory=list)


def local_shard(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This process's shard of `whole` (a tensor every process holds in full), laid out as the FSDP2 parameter
    `like` (a collective call); a 0-d tensor FSDP2 trains as [1] is reshaped first."""
    whole = whole.to(device=like.device, dtype=like.dtype).reshape(like.shape)
    return distribute_tensor(whole, like.device_mesh, like.placements).to_local()


def sharded_penalty(params: Sequence[DTensor], anchors: Sequence[torch.Tensor],
                    importances: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ Ω (θ − θ*)² over parameters FSDP2 holds as shards: each process sums its own shards (its gradient,
    2 Ω (θ − θ*), reaches exactly its shards, as DDP's averaged gradient of the whole sum would), and the value is
    the sum over processes (an all-reduce outside autograd)."""
    local = weighted_squares([param.to_local() for param in params], anchors, importances)
    total = all_reduce_sum_(local.detach().clone())
    return local + (total - local.detach())


def nonzero_rows(values: torch.Tensor) -> torch.Tensor:
    """Indices of the rows (dim 0) of `values` with any nonzero (or NaN) entry."""
    flat = values.flatten(1)
    # Two plain reductions, no temporary the size of `values`: 4x faster on CPU than `abs().amax()`.
    # amax and amin propagate NaN, and NaN != 0, so rows with NaN are kept.
    return ((flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)).nonzero().squeeze(1)


class QuadraticPenalty:
    """Anchors θ* and importances Ω by parameter name; `value(model)` is Σ Ω (θ − θ*)² over them.

    The token embedding is compacted to its rows with nonzero importance when they are at most `ROW_FRACTION` of
    its rows (a task's data touches few of the 49,408 tokens, and a token that never occurs has zero gradient, hence
    zero Fisher, MAS and SI importance): the penalty then reads and writes those rows only, its gradient a sparse
    row gradient that autograd adds to the embedding's dense gradient (the text tower runs every step).
    """

    ROW_FRACTION = 0.5

    def __init__(self, sparse_token_rows: bool = True) -> None:
        self.sparse_token_rows = sparse_token_rows
        self.anchor: dict[str, torch.Tensor] = {}
        self.importance: dict[str, torch.Tensor] = {}
        self._aligned_cache: _Aligned | None = None

    def __bool__(self) -> bool:
        return bool(self.importance)

    def set(self, importance: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
        """New importances, anchored at the current value of every parameter they cover."""
        missing = sorted(set(importance) - set(params))
        if missing:
            raise ValueError(f"No parameter to anchor for importance entries {missing}")
        self.importance = {name: value.detach().clone() for name, value in importance.items()}
        self.anchor = {name: params[name].detach().clone() for name in importance}
        self._aligned_cache = None

    def value(self, model: nn.Module) -> torch.Tensor | None:
        """Σ Ω (θ − θ*)² for `model`'s current parameters, or None before any importance exists."""
        if not self.importance:
            return None
        aligned = self._aligned(model)
        terms = [entry.value() for entry in aligned.rows]
        if aligned.shards:
            terms.append(sharded_penalty(aligned.shards, aligned.shard_anchors, aligned.shard_importances))
        if aligned.params:
            terms.append(weighted_squares(aligned.params, aligned.anchors, aligned.importances))
        return torch.stack(terms).sum() if len(terms) > 1 else terms[0]

    def _aligned(self, model: nn.Module) -> _Aligned:
        """The operands on the parameters' devices, rebuilt only when a parameter changed (device, shape, object)."""
        named = dict(model.named_parameters())
        missing = sorted(set(self.importance) - set(named))
        if missing:
            raise ValueError(f"The model has no parameter(s) {missing[:5]} that the penalty covers")
        params: list[torch.Tensor] = [named[name] for name in self.importance]
        key = tuple((id(p), p.device, p.dtype, p.shape) for p in params)
        if self._aligned_cache is None or self._aligned_cache.key != key:
            token_name = token_embedding_name(model) if self.sparse_token_rows else None
            self._aligned_cache = self._build(key, params, token_name)
        return self._aligned_cache

    def _build(self, key: tuple, params: list[torch.Tensor], token_name: str | None) -> _Aligned:
        if any(isinstance(param, DTensor) for param in params):
            return self._build_sharded(key, params)
        aligned = _Aligned(key, [], [], [], [])
        for name, param in zip(list(self.importance), params, strict=True):
            self.anchor[name] = anchor = fit_rows(self.anchor[name], param, param, name)
            self.importance[name] = importance = fit_rows(self.importance[name], param, None, name)
            rows = nonzero_rows(importance) if name == token_name and param.dim() == 2 else None
            if rows is not None and len(rows) <= self.ROW_FRACTION * param.shape[0]:
                aligned.rows.append(_RowEntry(param, rows, anchor[rows], importance[rows]))
            else:
                aligned.params.append(param)
                aligned.anchors.append(anchor)
                aligned.importances.append(importance)
        return aligned

    def _build_sharded(self, key: tuple, params: list[torch.Tensor]) -> _Aligned:
        """Under FSDP2, once per task: each process's shards of the anchors and importances of the parameters held
        as shards; the parameters FSDP2 holds whole at the loss (the root's, unsharded from its forward until the
        backward) keep whole ones, reshaped like them (a 0-d parameter trained as [1]). Dense only: FSDP2 takes no
        sparse gradient. The whole anchors and importances stay the method state, in the unsharded format."""
        aligned = _Aligned(key, [], [], [], [])
        for name, param in zip(list(self.importance), params, strict=True):
            anchor, importance = self.anchor[name], self.importance[name]
            if anchor.numel() != param.numel():
                raise ValueError(f"Parameter {name!r} has shape {tuple(param.shape)} but its stored penalty state "
                                 f"has {tuple(anchor.shape)}; a vocabulary grown under FSDP2 is not supported")
            if isinstance(param, DTensor):
                aligned.shards.append(param)
                aligned.shard_anchors.append(local_shard(anchor, param))
                aligned.shard_importances.append(local_shard(importance, param))
            else:
                aligned.params.append(param)
                aligned.anchors.append(anchor.to(device=param.device, dtype=param.dtype).reshape(param.shape))
                aligned.importances.append(importance.to(device=param.device, dtype=param.dtype).reshape(param.shape))
        return aligned

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": dict(self.anchor), "importance": dict(self.importance)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        anchor = dict(state.get("anchor", {}))
        importance = dict(state.get("importance", {}))
        if set(anchor) != set(importance):
            raise ValueError("Penalty state: anchor and importance cover different parameters")
        self.importance = importance
        self.anchor = {name: anchor[name] for name in importance}  # same order
        self._aligned_cache = None


#: The config of a subclass (`QuadraticPenaltyMethod[ItsConfig]`).
QuadraticPenaltyConfigT = TypeVar("QuadraticPenaltyConfigT", bound=QuadraticPenaltyConfig)


class QuadraticPenaltyMethod(ContinualMethod[QuadraticPenaltyConfigT]):
    """Base of EWC, SI and MAS: the penalty as a loss term, the parameter selection, the saved state.

    Subclasses define `strength` (the coefficient s in front of Σ Ω (θ − θ*)²) and update the importance at task
    end with `consolidate`. A parameter that did not train in a task (another pair's learner head, CMCL's EWC
    baseline) keeps its importance and anchor: it is neither decayed nor averaged, and `average` counts the tasks
    that trained each parameter. On a full CLIP every covered parameter trains every task, so this is the usual rule.
    """

    config_class = QuadraticPenaltyConfig
    roles = {"previous_model": "penalises moving away from the previous task's weights"}

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.penalty = QuadraticPenalty(self.config.sparse_token_rows)
        self.tasks_consolidated = 0
        self.parameter_tasks: dict[str, int] = {}  # tasks whose importance each parameter received

    @property
    def strength(self) -> float:
        raise NotImplementedError

    def covered_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters this method estimates importances for (trainable, not excluded)."""
        config = self.config
        return select_parameters(model, config.exclude_token_embedding, config.exclude_parameters)

    def loss_terms(
        self,
        model: ContinualDualEncoder,
        inputs: dict[str, torch.Tensor],
        outputs: ContinualDualEncoderOutput,
        context: TaskContext,
    ) -> dict[str, torch.Tensor]:
        """`penalty`: s · Σ Ω (θ − θ*)²; an exact 0 before the first importance (task 0)."""
        value = self.penalty.value(model)
        if value is None:
            return {PENALTY_TERM: next(model.parameters()).new_zeros(())}
        return {PENALTY_TERM: self.strength * value}

    def consolidate(
        self, model: nn.Module, importance: Mapping[str, torch.Tensor], rule: str, gamma: float
    ) -> None:
        """Merge a task's importance into the running one (per parameter, for the parameters it covers) and move
        their anchor θ* to the current values; the other parameters keep importance and anchor (see the class)."""
        old, current = self.penalty.importance, dict(model.named_parameters())
        merged = {name: value for name, value in old.items() if name not in importance}
        anchors = {name: self.penalty.anchor[name] for name in merged}
        for name, value in importance.items():
            before = {name: old[name]} if name in old else {}
            merged.update(accumulate_importance(before, {name: value}, rule, gamma, self.parameter_tasks.get(name, 0)))
            anchors[name] = current[name]
            self.parameter_tasks[name] = self.parameter_tasks.get(name, 0) + 1
        self.penalty.set(merged, anchors)
        self.tasks_consolidated += 1

    def state_dict(self) -> dict[str, Any]:
        return {"penalty": self.penalty.state_dict(), "tasks_consolidated": self.tasks_consolidated,
                "parameter_tasks": dict(self.parameter_tasks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.penalty.load_state_dict(state.get("penalty", {}))
        self.tasks_consolidated = int(state.get("tasks_consolidated", 0))
        default = self.tasks_consolidated  # a state saved before per-parameter counts: every parameter every task
        saved = state.get("parameter_tasks")
        self.parameter_tasks = ({str(k): int(v) for k, v in saved.items()} if saved is not None
                                else dict.fromkeys(self.penalty.importance, default))


# ----- the importance pass over a task's data ---------------------------------------------------------------------
def task_data(context: TaskContext, method: str) -> tuple[Callable[[list[dict[str, Any]]], dict], Any]:
    """The collator and dataset the loop puts in the context for the importance pass."""
    missing = [key for key in (COLLATOR_KEY, DATASET_KEY) if getattr(context, key) is None]
    if missing:
        raise ValueError(
            f"Method {method!r} estimates importances from the task's data at task end and needs "
            f"context.{COLLATOR_KEY} (a CLIPCollator in eval mode) and context.{DATASET_KEY} "
            f"(the dataset the task trained on); missing: {missing}"
        )
    return getattr(context, COLLATOR_KEY), getattr(context, DATASET_KEY)


def plan_batches(
    num_examples: int, batch_size: int, max_batches: int | None, seed: int, drop_last: bool = True
) -> list[list[int]]:
    """Example indices of each batch, the same on every process: the whole dataset in order, or a seeded random
    subset of `max_batches * batch_size` examples. With `drop_last`, an incomplete last batch is dropped unless it
    is the only one."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    wanted = num_examples if max_batches is None else min(num_examples, max_batches * batch_size)
    if wanted < num_examples:
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(num_examples, generator=generator)[:wanted].tolist()
    else:
        order = list(range(num_examples))
    batches = [order[start : start + batch_size] for start in range(0, wanted, batch_size)]
    if drop_last and len(batches) > 1 and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def task_batches(
    context: TaskContext, method: str, batch_size: int, max_batches: int | None, drop_last: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """This process's share (round-robin) of the planned batches of the task's data, collated."""
    collator, dataset = task_data(context, method)
    plan = plan_batches(len(dataset), batch_size, max_batches, seed=context.seed, drop_last=drop_last)
    for indices in plan[rank() :: world_size()]:
        yield collator([dataset[int(i)] for i in indices])


def batch_contrastive_loss(model: ContinualDualEncoder, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model family's loss (CLIP's softmax, SigLIP's sigmoid) of this process's batch alone (no all-gather), with
    the collator's positive mask; of a
    pair batch (cached features, `learner_heads`), the pair loss (CMCL Eq. 2)."""
    if "features_a" in batch:
        return model(**batch, return_loss=True).loss
    images = model.embed_images(**model.image_inputs(batch))
    texts = model.embed_texts(batch["input_ids"], batch.get("attention_mask"))
    logits = model.logits(images, texts)
    mask = positive_mask(batch["text_hash"], batch.get("image_hash")) if "text_hash" in batch else None
    return model.contrastive_loss(logits, mask)


def batch_task_loss(model: ContinualDualEncoder, batch: Mapping[str, torch.Tensor], class_prompts: Any = None
                    ) -> torch.Tensor:
    """The loss the task trains with, on this process's batch: the class-prompt cross-entropy (ZSCL Eq. 1,
    `hf_ccl.class_prompts`) for a classification task trained with `classification_loss: cross_entropy` (its
    `class_prompts`), else `batch_contrastive_loss`."""
    if class_prompts is None or "class_labels" not in batch:
        return batch_contrastive_loss(model, batch)
    labels = batch["class_labels"]
    images = model.embed_images(**model.image_inputs(batch))
    return class_prompt_loss(model, images, class_prompts.class_embeddings(model), labels,
                             class_prompts.candidate_mask(labels))


def squared_embedding_norms(model: ContinualDualEncoder, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean over the batch of ‖v‖² + ‖w‖², v and w the unnormalised projected image and text embeddings (MAS's
    ℓ2² output); for a one-example batch, that example's ‖v‖² + ‖w‖². A pair batch: the two learner outputs."""
    if "features_a" in batch:
        outputs = model(**batch, return_loss=False)
        return (outputs.z_a.float().pow(2).sum(-1) + outputs.z_b.float().pow(2).sum(-1)).mean()
    images = model.embed_images(**model.image_inputs(batch), normalize=False)
    texts = model.embed_texts(batch["input_ids"], batch.get("attention_mask"), normalize=False)
    return (images.float().pow(2).sum(-1) + texts.float().pow(2).sum(-1)).mean()


def split_examples(batch: Mapping[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """One-example batches of a collated batch (values that are not tensors, such as a pair batch's modality names,
    are kept as they are)."""
    size = next(value for value in batch.values() if isinstance(value, torch.Tensor)).shape[0]
    for index in range(size):
        yield {key: value[index : index + 1] if isinstance(value, torch.Tensor) else value
               for key, value in batch.items()}


def mean_gradient_statistic(
    model: nn.Module,
    batches: Iterator[Mapping[str, torch.Tensor]],
    params: Mapping[str, torch.Tensor],
    objective: Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor],
    statistic: str,
    per_example: bool = False,
) -> dict[str, torch.Tensor]:
    """Mean over units of stat(∂ objective(unit) / ∂θ), a unit being a batch or (`per_example`) one example.

    `statistic` is `square` (g², the empirical Fisher) or `abs` (|g|, MAS). Runs in eval mode (restored after),
    leaves `p.grad` untouched (`torch.autograd.grad`), accumulates in float32 and reduces the sums and the count
    over processes, so every process returns the same mean.
    """
    if statistic not in ("square", "abs"):
        raise ValueError(f"statistic must be 'square' or 'abs', got {statistic!r}")
    names, tensors = list(params), list(params.values())
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in tensors]
    device = tensors[0].device
    count = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            for unit in split_examples(batch) if per_example else (batch,):
                grads = [g.float() for g in torch.autograd.grad(objective(model, unit), tensors,
                                                                materialize_grads=True)]
                if statistic == "square":
                    torch._foreach_addcmul_(sums, grads, grads)
                else:
                    torch._foreach_add_(sums, torch._foreach_abs(grads))
                count += 1
    finally:
        model.train(was_training)
    for total in (*sums, count):
        all_reduce_sum_(total)
    if count.item() == 0:
        raise ValueError("The importance pass saw no data: the task's dataset is empty")
    return {name: (total / count).to(p.dtype) for name, total, p in zip(names, sums, tensors, strict=True)}
