"""GEM and A-GEM on a full CLIP: constrain every step so that the loss on an episodic memory of old tasks does not
increase (the projections themselves: `hf_ccl.methods.gem_projection`; spec cmcl.md §4).

GEM (Lopez-Paz & Ranzato, "Gradient Episodic Memory for Continual Learning", NeurIPS 2017, §3) asks that no old
task's memory loss grows, ℓ(f_θ, M_k) ≤ ℓ(f_θ^{t−1}, M_k) for k < t, to first order ⟨g̃, g_k⟩ ≥ 0 with g_k the
gradient of task k's memory loss; the step uses the closest such gradient to the current one g (Eqs. 10–11),
computed through the dual QP (Eqs. 12–13) with the official code's margin `memory_strength` and ridge `qp_eps`
(`project2cone2`; see `gem_projection.gem_project`). It projects only when some ⟨g, g_k⟩ < 0.

A-GEM (Chaudhry et al., "Efficient Lifelong Learning with A-GEM", ICLR 2019, §4) keeps one constraint, on the
gradient g_ref of a random memory batch of `reference_batch_size` rows drawn uniformly without replacement over all
memories, and projects with Eq. 11, g̃ = g − (gᵀg_ref / g_refᵀg_ref) g_ref, when gᵀg_ref < 0.

Episodic memory: at the end of task k (`on_task_end`) `memory_per_task` seeded random rows of the task's own
training split, kept as row indices into `context.stream[k].train` (as the replay buffer keeps references, never
tensors; all rows when the task has fewer). They are collated by the task's eval-mode `context.collator` (first
caption of each row, current tokenizer) once per task and kept collated for the task (on the model's device, or the
CPU with `memory_on_cpu`). A streaming (IterableDataset) train split has no row indices: a run whose tasks before the
last stream their training data is refused at task start.

The memory loss (a choice, documented): the CLIP contrastive loss of the model on the memory batch alone,
`regularization.batch_contrastive_loss` — the towers of the model (`embed_images` / `embed_texts`, the text prompt
included), `logit_scale`, and the collator's positive mask: on one process exactly `model(**batch,
return_loss=True).loss`. Not the model's `forward` itself, which all-gathers the batch over processes (every process
holds the same memory: that would duplicate it and communicate) and is the compiled entry point (the memory pass runs
on the bare model). Other methods' loss terms (distillation, penalties) are left out: GEM constrains the tasks'
losses, and those terms are regularisers of the current step, not losses of old tasks. A memory batch that mixes
tasks (A-GEM) is one contrastive batch, as replayed rows are. With `memory_batch_size` a memory batch is encoded in
chunks of that many rows and its loss is the size-weighted mean of the chunks' contrastive losses (fewer negatives).

The memory pass runs in eval mode (dropout off: the gradient of the old loss itself, not of a random sub-network;
every module's mode is restored after), under the run's bf16 autocast when `training.bf16` is set (the same precision
as the training gradient), in float32 under fp16 (there is no loss scaler for it; a non-finite g, an fp16 overflow
the loss scaler will skip, is left alone; GEM refuses fp16 without clipping, which leaves g multiplied by the loss
scale, to which its margin is not invariant). Gradients are taken with
`torch.autograd.grad` w.r.t. the selected parameters (`parameters`: fnmatch patterns over the model's parameter
names; those without `requires_grad` are left out), so `p.grad` is untouched until the projected gradient is written
back. Method-owned tensors (`optimizer_parameters`, e.g. CLL-CLIP's temperature) are not constrained.

Where it runs: `pre_optimizer_step`, after backward, gradient clipping and DDP's all-reduce, so g is the same on every
process; every process holds the same memory and parameters and computes the memory gradients itself (no
communication), so every process projects identically. After clipping, GEM's g̃ = g + Gᵀv may be longer than
`max_grad_norm` (A-GEM's projection never lengthens g). Put `gem` after other methods that edit gradients in
`pre_optimizer_step` (DNS, TEIR) so that its constraints hold on the gradient the optimizer uses.

Compute (`rows_per_step`): every step encodes and back-propagates the memory rows once per process: GEM all
rows of the past tasks' memories (min(memory_per_task, task size) per past task: 0 on the first task, growing with
the task index), A-GEM min(reference_batch_size, rows in memory). The run's MACs measure this work
(`hf_ccl.step_meter` counts `pre_optimizer_step` into the step).

Pair tasks (CMCL's setting, Liu et al., "Continual Multimodal Contrastive Learning", NeurIPS 2025; spec cmcl.md §4,
GEM with margin 0.5): list the method after `learner_heads`, which attaches the per-modality heads at task start,
freezes the CLIP and lets only the current pair's two heads train. Task k's memory holds row indices into its cached
feature split (`hf_ccl.pair_features`), batched with task k's own modalities (`PairFeatureCollator(task.modalities)`,
whichever pair trains now); its loss is the pair loss of Eq. 2 of CMCL on task k's heads, through the model
(`batch_contrastive_loss`, the forward's pair branch, which gathers nothing). The gradients are those of the
parameters that train (the current pair's heads, within `parameters`), so a past task that shares neither head with
the current pair has g_k = 0, no constraint, and is skipped (GEM: not a row of G; A-GEM: its drawn rows add nothing
to g_ref and are not encoded). Different pairs use different heads and their negatives come from their own task, so
an A-GEM memory batch is one batch per task drawn from, its loss the size-weighted sum Σ_k (n_k / n) L_k over the n
drawn rows. GEM's dual QP (Eqs. 12–13, margin `memory_strength`, ridge `qp_eps`) and A-GEM's projection (Eq. 11) are
the same as on a CLIP. Compute counts only the encoded rows: GEM's of the tasks sharing a head, A-GEM's expected
share of its reference batch drawn from them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from ..data.streaming import is_streaming
from ..data.task import ModelPart
from ..pair_features import FEATURE_COLUMNS, PairFeatureCollator
from ..validation import ConfigError, check_range
from .base import ContinualMethod, MethodConfig, TaskContext, pair_modalities
from .gem_projection import (
    add_to_grads_,
    agem_coefficient,
    agem_project,
    combine,
    flat_grad,
    gem_dual,
    gem_products,
    gram,
    write_flat_grad,
)
from .registry import register_method
from .regularization import batch_contrastive_loss

if TYPE_CHECKING:
    from ..data.task import Task
    from ..modeling import ContinualDualEncoder

logger = logging.getLogger(__name__)

#: The collated columns the memory loss reads (a pair task's: `FEATURE_COLUMNS`, with its modality names).
MEMORY_COLUMNS = ("pixel_values", "pixel_attention_mask", "spatial_shapes", "input_ids", "attention_mask",
                  "text_hash", "image_hash")


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class EpisodicMemoryConfig(MethodConfig):
    memory_per_task: int = field(
        default=256,
        metadata={
            "help": "Training examples stored per task (a seeded random subset of its train split, all of it when "
            "smaller); GEM's code: 256 per task, CMCL's buffer size (App. E)."
        },
    )
    parameters: list[str] = field(
        default_factory=lambda: ["*"],
        metadata={
            "help": "fnmatch patterns over parameter names whose gradient is constrained (and w.r.t. which memory "
            "gradients are taken), e.g. ['text_projection.weight', 'visual_projection.weight']; default every "
            "trainable parameter. Parameters without requires_grad are left out."
        },
    )
    memory_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per forward of a memory batch; None: a task's whole memory (GEM) or the whole reference "
            "batch (A-GEM) at once. Smaller bounds activation memory; the loss is then the size-weighted mean of the "
            "chunks' contrastive losses."
        },
    )
    memory_on_cpu: bool = field(
        default=False,
        metadata={
            "help": "Keep the collated memory on the CPU and copy each memory batch to the model's device when used "
            "(less accelerator memory, one host-to-device copy per step)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Memory seed, combined with the run's seed and the task index."})

    def __post_init__(self) -> None:
        check_range("memory_per_task", self.memory_per_task, 1)
        check_range("memory_batch_size", self.memory_batch_size, 1, also="or null")
        self.parameters = [str(pattern) for pattern in self.parameters]
        if not self.parameters:
            raise ConfigError("parameters must hold at least one pattern, e.g. ['*'] (every trainable parameter)",
                              "parameters")


@dataclass
class GEMConfig(EpisodicMemoryConfig):
    memory_strength: float = field(
        default=0.5,
        metadata={"help": "γ in v ≥ γ on GEM's dual variables (official `memory_strength`); CMCL's margin 0.5."},
    )
    qp_eps: float = field(
        default=1e-3,
        metadata={"help": "ε added to the diagonal of GGᵀ (official project2cone2); must be > 0."},
    )
    qp_tol: float = field(default=1e-10, metadata={"help": "Relative KKT tolerance of the QP solver; > 0."})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("memory_strength", self.memory_strength, 0)
        check_range("qp_eps", self.qp_eps, 0, low_open=True, also="(GGᵀ is singular with more tasks than parameters)")
        check_range("qp_tol", self.qp_tol, 0, low_open=True)


@dataclass
class AGEMConfig(EpisodicMemoryConfig):
    reference_batch_size: int = field(
        default=256,
        metadata={"help": "Memory rows in g_ref's batch, drawn uniformly over all memories at every step (A-GEM)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("reference_batch_size", self.reference_batch_size, 1)


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TaskMemory:
    """The stored rows of task `task_index`: indices into its train split, in their seeded random order."""

    task_index: int
    task_name: str
    rows: list[int]

    def __len__(self) -> int:
        return len(self.rows)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model.eval()` for the duration; then every module gets back its own mode (not one mode for all)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def concat_padded(
    parts: Sequence[Mapping[str, torch.Tensor]], pad_id: int, side: str, trim: bool = True
) -> dict[str, torch.Tensor]:
    """Collated batches concatenated row-wise: `input_ids` / `attention_mask` padded (on `side`, with `pad_id` and 0)
    to one width, then (`trim`) token columns no row attends to dropped, so a subset of collated rows equals the
    collator's own batch of those rows when it pads to the longest caption; `trim=False` for a collator that pads to
    `max_length` (SigLIP's families pool the last position)."""
    keys = list(parts[0])
    out: dict[str, torch.Tensor] = {}
    width = max(part["input_ids"].shape[1] for part in parts) if "input_ids" in parts[0] else 0
    for key in keys:
        values = []
        for part in parts:
            value = part[key]
            if key in ("input_ids", "attention_mask") and value.shape[1] < width:
                pad = (0, width - value.shape[1]) if side == "right" else (width - value.shape[1], 0)
                value = nn.functional.pad(value, pad, value=pad_id if key == "input_ids" else 0)
            values.append(value)
        out[key] = values[0] if len(values) == 1 else torch.cat(values)
    mask = out.get("attention_mask")
    if trim and mask is not None and "input_ids" in out:
        used = mask.bool().any(0)
        if not bool(used.all()):
            out["input_ids"], out["attention_mask"] = out["input_ids"][:, used], mask[:, used]
    return out


def _autocast(context: TaskContext, device: torch.device) -> contextlib.AbstractContextManager:
    """The run's bf16 autocast (as `ContinualTrainer` runs the loss), else none (float32; fp16 has no scaler here)."""
    args = context.training_args
    if args is not None and getattr(args, "bf16", False):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def pads_to_longest(context: TaskContext) -> bool:
    """Whether the task's collator pads texts to the longest in a batch (not to `max_length`, as for SigLIP)."""
    return getattr(context.collator, "padding", "longest") == "longest"


def batch_rows(batch: Mapping[str, Any]) -> int:
    """Rows of a collated batch (its first tensor's; a pair batch also holds its modality names)."""
    return int(next(value for value in batch.values() if isinstance(value, torch.Tensor)).shape[0])


def batch_chunks(batch: Mapping[str, Any], size: int, trim: bool = True) -> Iterator[tuple[dict[str, Any], float]]:
    """The batch in chunks of `size` rows, each with its share of the rows; with `trim`, a CLIP chunk drops the token
    columns none of its rows attends (as the collator's batch of those rows would, padding to the longest)."""
    rows = batch_rows(batch)
    for start in range(0, rows, size):
        chunk = {k: v[start : start + size] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if trim and size < rows and "input_ids" in chunk:
            chunk = concat_padded([chunk], 0, "right")
        yield chunk, batch_rows(chunk) / rows


def in_dtype(batch: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A pair batch's float features in the heads' dtype (the cached features are float32); other batches as
    they are."""
    if "features_a" not in batch:
        return dict(batch)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def trains_heads(task: Task) -> bool:
    """Whether `task` trains learner heads on cached features (a pair task, CMCL) rather than the towers."""
    return task.kind_spec.trains is ModelPart.LEARNER_HEADS


def head_parameter_ids(model: nn.Module, modalities: Sequence[str]) -> set[int]:
    """Ids of the parameters of the learner heads of `modalities` (none on a model without heads)."""
    heads = getattr(model, "learner_heads", None)
    if heads is None:
        return set()
    return {id(p) for modality in modalities if modality in heads.heads for p in heads.heads[modality].parameters()}


# ----------------------------------------------------------------------------------------------------------------
# The shared base
# ----------------------------------------------------------------------------------------------------------------
#: The config of a subclass (`EpisodicMemoryMethod[ItsConfig]`).
EpisodicMemoryConfigT = TypeVar("EpisodicMemoryConfigT", bound=EpisodicMemoryConfig)


class EpisodicMemoryMethod(ContinualMethod[EpisodicMemoryConfigT]):
    """Base of GEM and A-GEM: one memory per finished task (indices, in the method state), the selected parameters,
    and the gradient of the contrastive loss on a memory batch, of a CLIP or of the learner heads (module
    docstring)."""

    fsdp_refusal = ("it projects each step's gradient against the memory's over whole gradient vectors, and FSDP2 holds "
                    "every gradient as a shard; its memory pass also runs the towers outside the sharded forward")
    config_class = EpisodicMemoryConfig
    roles = {
        "previous_model": "constrains each step not to increase the loss on the memories of previous tasks",
        "gradient_constraint": "rewrites each gradient under constraints from an episodic memory",
    }
    conflicts = {"gradient_constraint": "rewrites each gradient under constraints from an episodic memory: use one"}
    trains_pair_tasks = True  # on pair tasks: the memories' pair losses, constraining the current pair's heads
    trains_on_past_tasks = True  # the memories' loss: under cross-entropy, each row among its own task's classes
    runs_after = {"learner_heads": "constrains the gradients of the learner heads, which learner_heads attaches at "
                  "task start"}

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.memories: list[TaskMemory] = []
        self._metrics: dict[str, float] = {}
        self._collated: dict[int, dict[str, torch.Tensor]] = {}
        self._collated_for: tuple[Any, torch.device] | None = None
        self._selection: tuple[nn.Module, list[str], list[nn.Parameter]] | None = None
        self._scratch_buffers: dict[str, torch.Tensor] = {}

    # ----- hooks -------------------------------------------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        """Refuse streaming train splits of the tasks whose memory a later task needs (all but the last)."""
        self._collated, self._collated_for, self._selection = {}, None, None
        self._scratch_buffers = {}
        later = context.stream.tasks[context.task_index : len(context.stream) - 1]
        streaming = [task.name for task in later if is_streaming(task.train)]
        if streaming:
            raise ValueError(
                f"{self.name}: the train split of task(s) {streaming} is a stream (IterableDataset); {self.name}'s "
                "episodic memory keeps row indices into map-style train splits. Load those tasks as datasets (not "
                "streaming), or use a method without a memory"
            )

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        """No override: checks, before training, that `parameters` select trainable parameters (every method's
        `on_task_start` has run, so `requires_grad` is final)."""
        self.selected_parameters(context.model)
        return {}

    def on_task_end(self, context: TaskContext) -> None:
        """Store `memory_per_task` seeded random rows of the task's train split (all of them when it has fewer)."""
        train = context.task.train
        if is_streaming(train):  # only the last task can get here (`on_task_start`): its memory is never used
            logger.warning("%s: task %r streams its training data; no memory is kept for it", self.name,
                           context.task.name)
            return
        count = len(train)
        if count == 0:
            return
        if count < self.config.memory_per_task:
            logger.info("%s: task %r has %d training examples, fewer than memory_per_task=%d: all are kept",
                        self.name, context.task.name, count, self.config.memory_per_task)
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index])
        rows = [int(row) for row in rng.permutation(count)[: self.config.memory_per_task]]
        memory = TaskMemory(context.task_index, context.task.name, rows)
        self.memories = sorted([m for m in self.memories if m.task_index != context.task_index] + [memory],
                               key=lambda m: m.task_index)
        self._collated.pop(context.task_index, None)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    # ----- parameters ----------------------------------------------------------------------------------------------
    def selected_parameters(self, model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
        """Names and parameters matched by `parameters` that require gradients, in `named_parameters` order (cached
        for the model until the next task). A pattern matching no parameter, or no trainable one matched at all,
        is a `ConfigError` naming `method_args.<method>.parameters`."""
        if self._selection is not None and self._selection[0] is model:
            return self._selection[1], self._selection[2]
        patterns = self.config.parameters
        key = f"method_args.{self.name}.parameters"
        named = list(model.named_parameters())
        unused = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name, _ in named)]
        if unused:
            raise ConfigError(f"{key}: pattern(s) {unused} match no parameter of the model (names look like "
                              "'text_projection.weight', 'vision_model.encoder.layers.0.mlp.fc1.weight')", key)
        chosen = [(name, p) for name, p in named
                  if p.requires_grad and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]
        if not chosen:
            raise ConfigError(f"{key}: {patterns} match no trainable parameter (all have requires_grad=False)", key)
        names, params = [name for name, _ in chosen], [p for _, p in chosen]
        self._selection = (model, names, params)
        return names, params

    # ----- memory batches ------------------------------------------------------------------------------------------
    def past_memories(self, context: TaskContext) -> list[TaskMemory]:
        """Memories of the tasks before the current one."""
        return [m for m in self.memories if m.task_index < context.task_index]

    def memory_task(self, context: TaskContext, memory: TaskMemory) -> Task:
        """The task of the stream that `memory` was taken from (its rows index that task's train split)."""
        stream = context.stream
        train = stream[memory.task_index].train if memory.task_index < len(stream) else None
        size = -1 if train is None or is_streaming(train) else len(train)
        if max(memory.rows) >= size:
            raise ValueError(
                f"{self.name}: the memory of task {memory.task_index} ({memory.task_name!r}) refers to rows up to "
                f"{max(memory.rows)}, which stream {stream.name!r} does not have; was it built on another stream "
                "or subsample?"
            )
        return stream[memory.task_index]

    def constraining_memories(
        self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]
    ) -> list[TaskMemory]:
        """The past memories whose loss depends on `params`: all of them on a CLIP. On pair tasks a past pair that
        shares no head with `params` (the current pair's heads) has g_k = 0: no constraint, skipped."""
        memories = self.past_memories(context)
        if not memories or getattr(model, "learner_heads", None) is None:
            return memories
        ids = {id(p) for p in params}

        def constrains(memory: TaskMemory) -> bool:
            task = self.memory_task(context, memory)
            return not trains_heads(task) or bool(ids & head_parameter_ids(model, task.modalities or ()))

        return [memory for memory in memories if constrains(memory)]

    def _memory_collator(self, context: TaskContext, task: Task) -> Any:
        """What batches a memory: a pair task's own `PairFeatureCollator` (its modalities, whichever pair trains
        now), else the run's eval-mode CLIP collator."""
        if trains_heads(task) and task.modalities is not None:
            return PairFeatureCollator(task.modalities)
        if context.collator is None:
            raise ValueError(f"{self.name} needs context.collator (an eval-mode CLIPCollator, set by ContinualLearner)")
        return context.collator

    def _collated_memory(self, context: TaskContext, memory: TaskMemory, device: torch.device) -> dict[str, torch.Tensor]:
        """Task `memory`'s rows collated (its tensors), once per task and device (and `context.collator`)."""
        collator = context.collator
        if self._collated_for is None or self._collated_for[0] is not collator or self._collated_for[1] != device:
            self._collated, self._collated_for = {}, (collator, device)
        if memory.task_index not in self._collated:
            task = self.memory_task(context, memory)
            batch = self._memory_collator(context, task)([task.train[row] for row in memory.rows])
            columns = FEATURE_COLUMNS if trains_heads(task) else MEMORY_COLUMNS
            self._collated[memory.task_index] = {k: batch[k].to(device) for k in columns if k in batch}
        return self._collated[memory.task_index]

    def memory_batch(
        self,
        context: TaskContext,
        parts: Sequence[tuple[TaskMemory, torch.Tensor | None]],
        device: torch.device,
        order: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """A collated memory batch on `device`: for each (memory, positions) the rows at `positions` of that memory
        (None: all), concatenated; `order` then permutes the rows. Equal to the collator's batch of those rows. A pair
        task's memory is batched alone (its own heads and negatives), with its modality names."""
        pair = [m.task_index for m, _ in parts if trains_heads(self.memory_task(context, m))]
        if pair and len({m.task_index for m, _ in parts}) > 1:
            raise ValueError(f"{self.name}: pair memories are batched one task at a time, got tasks "
                             f"{sorted({m.task_index for m, _ in parts})}")
        store = torch.device("cpu") if self.config.memory_on_cpu else device
        selected = []
        for memory, positions in parts:
            collated = self._collated_memory(context, memory, store)
            if positions is not None:
                collated = {k: v.index_select(0, positions.to(v.device, non_blocking=True)) for k, v in collated.items()}
            selected.append(collated)
        tokenizer = getattr(context.collator, "tokenizer", None)
        pad_id = getattr(tokenizer, "pad_token_id", None)
        side = getattr(tokenizer, "padding_side", "right")
        batch: dict[str, Any] = concat_padded(selected, 0 if pad_id is None else int(pad_id), side, trim=pads_to_longest(context))
        if order is not None:
            batch = {k: v.index_select(0, order.to(v.device, non_blocking=True)) for k, v in batch.items()}
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if pair:
            batch["modality_a"], batch["modality_b"] = pair_modalities(self.memory_task(context, parts[0][0]))
        return batch

    def loss_gradient(
        self,
        model: ContinualDualEncoder,
        context: TaskContext,
        params: Sequence[nn.Parameter],
        batch: Mapping[str, Any],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """∇ of the contrastive loss (a pair batch's: Eq. 2 of CMCL) of `model` on the memory `batch` w.r.t.
        `params`, flat (written into `out` when given), in the parameters' dtype (eval mode, the run's bf16
        autocast; `p.grad` untouched). With `memory_batch_size` the batch is encoded in chunks and the loss is the
        size-weighted mean of theirs."""
        return self.weighted_loss_gradient(model, context, params, [(batch, 1.0)], out)

    def weighted_loss_gradient(
        self,
        model: ContinualDualEncoder,
        context: TaskContext,
        params: Sequence[nn.Parameter],
        batches: Sequence[tuple[Mapping[str, Any], float]],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """∇ of Σ_i w_i L(batch_i) w.r.t. `params`, for (batch_i, w_i) in `batches` (`loss_gradient` of each)."""
        size = self.config.memory_batch_size
        device, dtype = params[0].device, params[0].dtype
        total: list[torch.Tensor] = []
        with eval_mode(model), torch.enable_grad(), _autocast(context, device):
            for batch, weight in batches:
                for chunk, share in batch_chunks(batch, size or batch_rows(batch), trim=pads_to_longest(context)):
                    loss = batch_contrastive_loss(model, in_dtype(chunk, dtype)).float() * (weight * share)
                    grads = [g.to_dense() if g.is_sparse else g
                             for g in torch.autograd.grad(loss, list(params), materialize_grads=True)]
                    if total:
                        torch._foreach_add_(total, grads)
                    else:
                        total = list(grads)  # autograd's own fresh tensors: accumulated into in place
        flat = [g.reshape(-1).to(p.dtype) for g, p in zip(total, params, strict=True)]
        return torch.cat(flat, out=out) if out is not None else torch.cat(flat)

    @staticmethod
    def _nonfinite_memory(what: str, context: TaskContext) -> FloatingPointError:
        return FloatingPointError(
            f"Non-finite {what} at task {context.task_index} ({context.task.name!r}), step "
            f"{context.global_step + 1}: the memory loss overflowed (lower the learning rate or use float32)"
        )

    # ----- compute accounting --------------------------------------------------------------------------------------
    def rows_per_step(self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]) -> float:
        """Memory rows encoded and back-propagated per step while task `context.task_index` trains `params`."""
        raise NotImplementedError

    def _start_step(self, model: ContinualDualEncoder, context: TaskContext) -> tuple[list[nn.Parameter], torch.Tensor] | None:
        """The selected parameters and their flat gradient g, or None when there is no memory yet."""
        if not self.past_memories(context):
            return None
        _, params = self.selected_parameters(model)
        return params, flat_grad(params, out=self._scratch("g", (self._numel(params),), params))

    @staticmethod
    def _numel(params: Sequence[nn.Parameter]) -> int:
        return sum(p.numel() for p in params)

    def _scratch(self, name: str, shape: tuple[int, ...], params: Sequence[nn.Parameter]) -> torch.Tensor:
        """An uninitialised tensor of `shape` in the parameters' dtype and device for this step's `name` (the flat g,
        G, g_ref). On the CPU it is kept and reused from step to step (dropped at task start): glibc serves a tensor
        this large (over 32 MiB) with fresh pages from the kernel, faulted in again at every step (a flat ViT-B/32
        gradient: about 6x the cost of the copy into it). An accelerator's caching allocator reuses memory itself:
        there a fresh tensor is returned and nothing is held between steps."""
        dtype, device = params[0].dtype, params[0].device
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        buffer = self._scratch_buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = self._scratch_buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buffer

    # ----- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "task_index": [m.task_index for m in self.memories],
            "task_name": [m.task_name for m in self.memories],
            "rows": [torch.tensor(m.rows, dtype=torch.int64) for m in self.memories],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        columns = [list(state.get(key, [])) for key in ("task_index", "task_name", "rows")]
        if len({len(column) for column in columns}) != 1:
            raise ValueError(f"{self.name} state: memory fields of different lengths {[len(c) for c in columns]}")
        self.memories = sorted(
            (TaskMemory(int(t), str(name), [int(r) for r in torch.as_tensor(rows).tolist()])
             for t, name, rows in zip(*columns, strict=True)),
            key=lambda m: m.task_index,
        )
        self._collated, self._collated_for, self._metrics = {}, None, {}


# ----------------------------------------------------------------------------------------------------------------
# GEM
# ----------------------------------------------------------------------------------------------------------------
@register_method
class GEM(EpisodicMemoryMethod[GEMConfig]):
    """GEM: project the gradient so that no past task's memory loss increases (Eqs. 10–13; module docstring).

    Metrics of the last step: `constraints` (past tasks whose memory loss depends on the constrained parameters:
    all of them on a CLIP, those sharing a head with the current pair on pair tasks), `violations` (those with
    ⟨g, g_k⟩ < 0), `projected` (1 when g was replaced; its mean over a logging window is the projected fraction),
    `grad_change` (‖g̃ − g‖ / ‖g‖), `dual_max` (max v*) and `nonfinite_grad` (1 when g was not finite and left
    alone)."""

    name = "gem"
    test_options = {"memory_per_task": 16}  # a memory that fills on 64-example tasks
    test_families = ("siglip2",)
    config_class = GEMConfig
    config: GEMConfig

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        """Also refuses fp16 without clipping: `p.grad` still carries the loss scale when `pre_optimizer_step` runs
        (only clipping unscales it first), and GEM's projection (its margin) is not scale-invariant."""
        if training.get("fp16") and not (training.get("max_grad_norm", 1.0) or 0) > 0:
            raise ConfigError("gem with training.fp16 needs training.max_grad_norm > 0: without clipping the gradient "
                              "it projects is still multiplied by the loss scale (use bf16, or clip)",
                              "training.max_grad_norm")
        return super().training_overrides(context, training)

    def rows_per_step(self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]) -> float:
        return float(sum(len(m) for m in self.constraining_memories(model, context, params)))

    def memory_gradients(
        self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]
    ) -> tuple[list[TaskMemory], torch.Tensor]:
        """The constraining past memories (`constraining_memories`) and G [k, P]: row k the gradient of task k's
        memory loss (its whole memory, one batch) w.r.t. `params`, in their dtype (on the CPU a scratch buffer that
        the next step overwrites)."""
        memories = self.constraining_memories(model, context, params)
        device = params[0].device
        G = self._scratch("G", (len(memories), self._numel(params)), params)
        for row, memory in zip(G, memories, strict=True):
            self.loss_gradient(model, context, params, self.memory_batch(context, [(memory, None)], device), out=row)
        return memories, G

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """Replace g by GEM's projection g̃ = Gᵀv* + g when some ⟨g, g_k⟩ < 0 (Eqs. 12–13)."""
        self._metrics = dict.fromkeys(
            ("constraints", "violations", "projected", "grad_change", "dual_max", "nonfinite_grad"), 0.0)
        started = self._start_step(model, context)
        if started is None:
            return
        params, g = started
        memories, G = self.memory_gradients(model, context, params)
        GGt, Gg, gg = gem_products(G, g)  # one pass over G and g, summed in float64
        if not bool(torch.isfinite(gg)):  # fp16's loss scaler skips this step: leave g alone
            self._metrics["nonfinite_grad"] = 1.0
            return
        if not bool(torch.isfinite(GGt.diagonal()).all()):
            raise self._nonfinite_memory("GEM memory gradient", context)
        violations = int((Gg < 0).sum())
        self._metrics.update(constraints=float(len(memories)), violations=float(violations))
        if violations == 0:
            return
        config = self.config
        v = gem_dual(GGt, Gg, config.memory_strength, config.qp_eps, config.qp_tol)
        write_flat_grad(params, combine(g, G, v, out=g))  # g̃ over g (its buffer), which is not read again
        v_on = v.to(GGt.device)
        change2, norm2 = float(v_on @ GGt @ v_on), float(gg)  # ‖g̃ − g‖² = ‖Gᵀv‖² = vᵀGGᵀv
        self._metrics.update(
            projected=1.0,
            grad_change=(max(change2, 0.0) / norm2) ** 0.5 if norm2 > 0 else 0.0,
            dual_max=float(v.max()),
        )


# ----------------------------------------------------------------------------------------------------------------
# A-GEM
# ----------------------------------------------------------------------------------------------------------------
@register_method
class AGEM(EpisodicMemoryMethod[AGEMConfig]):
    """A-GEM: one constraint, on the gradient of a random memory batch (Eq. 11; module docstring).

    Metrics of the last step: `projected` (1 when gᵀg_ref < 0), `grad_change` (‖g̃ − g‖ / ‖g‖), `ref_cosine`
    (cos(g, g_ref); 0 when g_ref = 0) and `nonfinite_grad`."""

    name = "agem"
    test_options = {"memory_per_task": 16, "reference_batch_size": 8}  # a memory that fills on 64-example tasks
    test_families = ("siglip",)
    config_class = AGEMConfig
    config: AGEMConfig

    def rows_per_step(self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]) -> float:
        """The reference batch, less (on pair tasks) the expected rows of tasks sharing no head, which are skipped."""
        total = sum(len(m) for m in self.past_memories(context))
        used = sum(len(m) for m in self.constraining_memories(model, context, params))
        return min(self.config.reference_batch_size, total) * used / total if total else 0.0

    def reference_rows(self, context: TaskContext) -> tuple[list[tuple[TaskMemory, torch.Tensor]], torch.Tensor]:
        """This step's memory batch: `reference_batch_size` rows drawn uniformly without replacement over every past
        memory, seeded by (seed, run seed, task, global step), so every process (and a resumed run) draws the same.
        Returns (memory, sorted positions) per task drawn from and the permutation that puts the grouped rows back
        in the draw's (random) order."""
        memories = self.past_memories(context)
        sizes = [len(m) for m in memories]
        total = sum(sizes)
        rng = np.random.default_rng([self.config.seed, context.seed, context.task_index, context.global_step])
        picks = rng.choice(total, size=min(total, self.config.reference_batch_size), replace=False)
        grouped = np.argsort(picks, kind="stable")  # positions in `picks` of the rows, by memory and row
        bounds = np.cumsum([0, *sizes])
        parts = []
        for k, memory in enumerate(memories):
            mine = np.sort(picks[(picks >= bounds[k]) & (picks < bounds[k + 1])]) - bounds[k]
            if len(mine):
                parts.append((memory, torch.as_tensor(mine, dtype=torch.int64)))
        order = torch.as_tensor(np.argsort(grouped, kind="stable"), dtype=torch.int64)
        return parts, order

    def reference_gradient(
        self, model: ContinualDualEncoder, context: TaskContext, params: Sequence[nn.Parameter]
    ) -> torch.Tensor:
        """g_ref: the gradient of the contrastive loss on this step's memory batch w.r.t. `params` (on pair tasks,
        of Σ_k (n_k / n) L_k over the tasks drawn from: `pair_reference_gradient`). On the CPU the tensor is a
        scratch buffer that the next step overwrites (`_scratch`)."""
        parts, order = self.reference_rows(context)
        if trains_heads(self.memory_task(context, parts[0][0])):
            return self.pair_reference_gradient(model, context, params, parts)
        batch = self.memory_batch(context, parts, params[0].device, order)
        out = self._scratch("g_ref", (self._numel(params),), params)
        return self.loss_gradient(model, context, params, batch, out=out)

    def pair_reference_gradient(
        self,
        model: ContinualDualEncoder,
        context: TaskContext,
        params: Sequence[nn.Parameter],
        parts: Sequence[tuple[TaskMemory, torch.Tensor]],
    ) -> torch.Tensor:
        """∇ of Σ_k (n_k / n) L_k: L_k the pair loss of the n_k rows drawn from task k (one batch per task, its own
        heads and negatives), n the rows drawn. Tasks sharing no head with `params` add 0 and are skipped; g_ref = 0
        (no projection) when every drawn task is skipped."""
        drawn = sum(len(positions) for _, positions in parts)
        relevant = {m.task_index for m in self.constraining_memories(model, context, params)}
        batches = [(self.memory_batch(context, [(memory, positions)], params[0].device), len(positions) / drawn)
                   for memory, positions in parts if memory.task_index in relevant]
        if not batches:
            return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        return self.weighted_loss_gradient(model, context, params, batches)

    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """Replace g by g − (gᵀg_ref / g_refᵀg_ref) g_ref when gᵀg_ref < 0 (Eq. 11)."""
        self._metrics = dict.fromkeys(("projected", "grad_change", "ref_cosine", "nonfinite_grad"), 0.0)
        started = self._start_step(model, context)
        if started is None:
            return
        params, g = started
        g_ref = self.reference_gradient(model, context, params)
        products = gram([g, g_ref])  # blocks summed in float64
        (gg, gr), (_, rr) = products.tolist()  # one read-back per step: the projection test needs the host
        if not math.isfinite(gg):  # fp16's loss scaler skips this step: leave g alone
            self._metrics["nonfinite_grad"] = 1.0
            return
        if not math.isfinite(rr):
            raise self._nonfinite_memory("A-GEM reference gradient", context)
        if gg > 0 and rr > 0:
            self._metrics["ref_cosine"] = gr / (gg * rr) ** 0.5
        alpha = agem_coefficient(gr, rr)
        if alpha is None:
            return
        if not add_to_grads_(params, g_ref, alpha):  # in place on p.grad where it can be (the same values)
            write_flat_grad(params, agem_project(g, g_ref, (gr, rr))[0])
        self._metrics.update(projected=1.0, grad_change=abs(gr) / (gg * rr) ** 0.5)  # ‖g̃ − g‖ = |gᵀr| / ‖r‖
