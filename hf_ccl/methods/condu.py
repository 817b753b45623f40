"""ConDU, Continual Decoupling-Unifying (Gao, Zhang, Wei, Zhao, Li, Li, Kong, Huang, "Enhanced Continual Learning of
Vision-Language Models with Model Fusion", ICLR 2026; arXiv 2503.10705): model fusion for continual learning.

ConDU keeps one unified task vector, a task trigger (a mask and a rescaler) per learned task and a prototype set per
task. Every task fine-tunes the whole model from the model before the first task, θ0, to θ_t; then

- **decoupling**: each earlier task's expert is rebuilt from the unified vector and its trigger,
  δ̂_i = U ⊙ M_i · λ_i (`decouple`);
- **unifying**: the experts δ̂_1..δ̂_{t-1} and the new task vector δ_t = θ_t − θ0 are merged (`unify`), per tensor:
  the elected sign s = sign(mean_i δ_i) (+1 where the mean is > 0, else −1), the masks M_i = [δ_i ⊙ s > 0], the
  unified vector U = s ⊙ max_i |M_i ⊙ δ_i|, and the rescalers λ_i = Σ_n mean|δ_i,n| / Σ_n mean|U_n ⊙ M_i,n| (sums
  over the tensors n; a trigger whose masked vector is all zero gets λ_i = 0);
- **prototypes**: per class c of the task, p_c = normalise((mean of the normalised θ0 image embeddings of its training
  images + mean of its normalised θ0 template-prompt embeddings) / 2); a class without images keeps the text mean
  (`class_prototypes`).

Inference (`ConDUExperts`, scored by the evaluator's ensemble hook, `hf_ccl.evaluation.ensemble`):
- a learned task, with task identity (`inference="task_identity"`, MTIL): its decoupled expert θ0 + δ̂_t, both towers;
- otherwise (a task not learned yet, every task with `inference="agnostic"`, and every task's scores among the seen
  or all classes, `class_scope: seen | all`, which give no task identity: X-TAIL), **semantic voting**: each image's
  similarity to a learned task is its largest cosine to that task's prototypes (frozen θ0 image embedding); the
  class scores are the mean of the cosine scores of θ0 and of the `top_k` most similar tasks' experts
  (`semantic_voting_weights`).

**What was read.** The paper's method section could not be read here (only its abstract and introduction): the
formulas above are those of the official code (github.com/zhangzicong518/ConDU @ HEAD), with no equation numbers:
- src/delta_models.py `unify_delta_models`: sign of the mean, masks, max-magnitude unified vector, rescalers
  `scales / new_scales` (sums of per-tensor mean absolute values); `DeltaModel`: δ = θ_fine-tuned − θ_pretrained
  over the float tensors of the state dict;
- src/main.py: each session decouples the stored triggers (`unified * masks * rescaler`), appends the new task's
  vector and unifies them all again; prototypes are kept per task;
- src/models/finetune.py: each task is fine-tuned from the pretrained CLIP (scripts/MTIL_FT.sh passes no `--load`),
  prototypes as above (ViT features of the pretrained model, its templates' text mean);
- src/models/evaluation.py `evaluate`: a learned task is scored by its expert, `agnostic_evaluate` (semantic voting):
  the pretrained model always, then the sessions by decreasing prototype similarity, `--logits_num` 4 of them
  (src/args.py), logits averaged; scripts/eval_MTIL_FT.sh uses `evaluate` on the learned tasks and semantic voting
  on the others (`inference="task_identity"`), eval_agnostic_MTIL_FT.sh semantic voting everywhere ("agnostic").
Not reproduced: the official training loss (cross-entropy with label smoothing 0.2, AdamW 1000 iterations, the
logit scale frozen): a run trains with its own `classification_loss` and `training` options.

**Checkpoints.** A task checkpoint's weights are θ0 (plain transformers loads the frozen model, route -1); the unified
vector, the triggers, the prototypes and θ0 are the method state (`method_state.safetensors`), restored exactly on
resume. `load_condu_model(task_folder)` returns the model with its experts attached: what the run evaluated.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ..data.templates import format_template
from ..evaluation.encode import encode_images, encode_texts, unwrap
from ..evaluation.zeroshot import DEFAULT_TEMPLATES
from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .loading import CheckpointLoader
from .registry import register_method
from .state import load_checkpoint_method

if TYPE_CHECKING:
    from ..data.task import TaskStream
    from ..modeling import ContinualDualEncoder

logger = logging.getLogger(__name__)

NAME = "condu"
MODULE = "condu_experts"  #: the attribute of the model that holds `ConDUExperts`


# ----------------------------------------------------------------------------------------------------------------
# The fusion itself: pure functions on task vectors
# ----------------------------------------------------------------------------------------------------------------
def unify(deltas: Sequence[Mapping[str, torch.Tensor]]
          ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], torch.Tensor]:
    """The unified vector U, the masks M_i and the rescalers λ_i of task vectors δ_1..δ_T (module docstring;
    `unify_delta_models` of the official code)."""
    if not deltas:
        raise ValueError("unify needs at least one task vector")
    names = list(deltas[0])
    for index, delta in enumerate(deltas[1:], start=1):
        if set(delta) != set(names):
            raise ValueError(f"task vector {index} has other tensors than task vector 0: "
                             f"{sorted(set(delta) ^ set(names))[:5]}")
    count = len(deltas)
    scales = torch.zeros(count, dtype=torch.float64)
    masked_scales = torch.zeros(count, dtype=torch.float64)
    unified: dict[str, torch.Tensor] = {}
    masks: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for name in names:
        stacked = torch.stack([delta[name] for delta in deltas])
        sign = torch.where(stacked.mean(dim=0) > 0, 1.0, -1.0).to(stacked.dtype)
        agree = stacked * sign > 0
        unified[name] = (stacked.abs() * agree).amax(dim=0) * sign
        for index in range(count):
            masks[index][name] = agree[index]
            scales[index] += stacked[index].abs().double().mean()
            masked_scales[index] += (unified[name] * agree[index]).abs().double().mean()
    rescalers = torch.where(masked_scales > 0, scales / masked_scales.clamp_min(1e-300), 0.0).float()
    return unified, masks, rescalers


def decouple(unified: Mapping[str, torch.Tensor], mask: Mapping[str, torch.Tensor], rescaler: float | torch.Tensor
             ) -> dict[str, torch.Tensor]:
    """The decoupled expert δ̂_i = U ⊙ M_i · λ_i of a task (module docstring)."""
    return {name: tensor * mask[name] * rescaler for name, tensor in unified.items()}


def class_prototypes(image_embeds: torch.Tensor, labels: torch.Tensor, text_means: torch.Tensor) -> torch.Tensor:
    """Prototypes [C, D] of a task's classes: normalise((mean of normalised image embeddings of class c + `text_means`
    [C, D], the mean of its normalised template embeddings) / 2); a class without images: its text mean, normalised."""
    classes = text_means.shape[0]
    images = nn.functional.normalize(image_embeds.float(), dim=-1)
    labels = labels.to(images.device, torch.long)
    sums = torch.zeros(classes, images.shape[1], device=images.device).index_add_(0, labels, images)
    counts = torch.bincount(labels, minlength=classes).to(images.device)
    image_means = sums / counts.clamp_min(1).unsqueeze(1)
    texts = text_means.float().to(images.device)
    prototypes = torch.where((counts > 0).unsqueeze(1), (image_means + texts) / 2, texts)
    return nn.functional.normalize(prototypes, dim=-1)


def semantic_voting_weights(frozen_image_embeds: torch.Tensor, prototype_sets: Sequence[torch.Tensor], top_k: int
                            ) -> torch.Tensor:
    """Weights [N, T + 1] of semantic voting: 1 / (k + 1) on θ0 (column 0) and on each image's k = min(top_k, T) tasks
    of largest prototype similarity (column 1 + t), that of task t being max_c cos(image, p_{t,c})."""
    images = nn.functional.normalize(frozen_image_embeds.float(), dim=-1)
    similarity = torch.stack([(images @ nn.functional.normalize(protos.float().to(images.device), dim=-1).T)
                              .amax(dim=1) for protos in prototype_sets], dim=1)
    k = min(int(top_k), len(prototype_sets))
    chosen = torch.sort(similarity, dim=1, descending=True, stable=True).indices[:, :k]
    weights = torch.zeros(images.shape[0], len(prototype_sets) + 1, device=images.device)
    weights[:, 0] = 1.0
    weights.scatter_(1, chosen + 1, 1.0)
    return weights / (k + 1)


# ----------------------------------------------------------------------------------------------------------------
# What is kept, and the model module the evaluator scores through
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ExpertStore:
    """θ0, the unified vector, the triggers and the prototypes (on the CPU), in task order."""

    initial: dict[str, torch.Tensor] | None = None
    unified: dict[str, torch.Tensor] | None = None
    masks: list[dict[str, torch.Tensor]] = field(default_factory=list)
    rescalers: list[float] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    prototypes: list[torch.Tensor] = field(default_factory=list)

    def expert(self, index: int) -> dict[str, torch.Tensor]:
        """Task `index`'s decoupled expert δ̂."""
        if self.unified is None:
            raise ValueError(f"{NAME}: no task has been learned")
        return decouple(self.unified, self.masks[index], self.rescalers[index])

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "unified": self.unified, "masks": self.masks,
                "rescalers": list(self.rescalers), "tasks": list(self.tasks), "prototypes": self.prototypes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        def cpu(tensors: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
            return None if tensors is None else {name: t.detach().cpu() for name, t in tensors.items()}

        self.initial, self.unified = cpu(state.get("initial")), cpu(state.get("unified"))
        self.masks = [cpu(mask) or {} for mask in state.get("masks") or []]
        self.rescalers = [float(value) for value in state.get("rescalers") or []]
        self.tasks = [str(name) for name in state.get("tasks") or []]
        self.prototypes = [t.detach().cpu() for t in state.get("prototypes") or []]
        if not len(self.masks) == len(self.rescalers) == len(self.tasks) == len(self.prototypes):
            raise ValueError(f"{NAME} state: {len(self.tasks)} tasks, {len(self.masks)} masks, {len(self.rescalers)} "
                             f"rescalers and {len(self.prototypes)} prototype sets")


@contextlib.contextmanager
def added_to(model: nn.Module, delta: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """A block inside which `model`'s parameters are θ + δ (restored bit for bit afterwards)."""
    params = dict(unwrap(model).named_parameters())
    saved = {name: params[name].detach().clone() for name in delta}
    with torch.no_grad():
        for name, value in delta.items():
            params[name].add_(value.to(params[name].device, params[name].dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)


class ConDUExperts(nn.Module):
    """The experts and semantic voting of a ConDU model (`hf_ccl.evaluation.ensemble.EvaluationEnsemble`). It holds
    no parameters or buffers: nothing of it is saved with the weights, which stay θ0."""

    def __init__(self, store: ExpertStore, inference: str, top_k: int):
        super().__init__()
        self.store, self.inference, self.top_k = store, inference, int(top_k)

    def ensemble_weights(self, frozen_image_embeds: torch.Tensor, task_name: str | None) -> torch.Tensor | None:
        """None before the first task; a learned task's own expert with `inference="task_identity"` when the task is
        known (`task_name`; None under the task-agnostic class scopes, X-TAIL's); else semantic voting
        (`semantic_voting_weights`)."""
        store = self.store
        if not store.tasks:
            return None
        if self.inference == "task_identity" and task_name in store.tasks:
            weights = torch.zeros(frozen_image_embeds.shape[0], len(store.tasks) + 1)
            weights[:, 1 + store.tasks.index(task_name)] = 1.0
            return weights
        return semantic_voting_weights(frozen_image_embeds, store.prototypes, self.top_k)

    def evaluation_route(self, model: nn.Module, route: int) -> contextlib.AbstractContextManager[None]:
        """Route -1: the model as it is (θ0); route t: θ0 + δ̂_t, task t's decoupled expert."""
        return contextlib.nullcontext() if route < 0 else added_to(model, self.store.expert(route))


def attach_experts(model: nn.Module, store: ExpertStore, config: ConDUConfig) -> ConDUExperts:
    """Attach (or update) the model's `ConDUExperts`."""
    target = unwrap(model)
    experts = getattr(target, MODULE, None)
    if not isinstance(experts, ConDUExperts):
        experts = ConDUExperts(store, config.inference, config.top_k)
        target.add_module(MODULE, experts)
    experts.store, experts.inference, experts.top_k = store, config.inference, config.top_k
    return experts


def float_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point parameters, detached copies on the CPU."""
    return {name: p.detach().cpu().clone() for name, p in unwrap(model).named_parameters() if p.is_floating_point()}


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class ConDUConfig(MethodConfig):
    inference: Literal["task_identity", "agnostic"] = field(
        default="task_identity",
        metadata={"help": "'task_identity' (MTIL, the official eval_MTIL scripts): a learned task is scored by its "
                          "decoupled expert, the others by semantic voting; 'agnostic' (task-agnostic MTIL): semantic "
                          "voting for every task."},
    )
    top_k: int = field(
        default=4,
        metadata={"help": "Experts averaged with θ0 in semantic voting, the most prototype-similar tasks (the "
                          "official --logits_num 4)."},
    )
    prototype_examples: int | None = field(
        default=None,
        metadata={"help": "Training images per task its class prototypes average (a seeded subset); None: all of "
                          "them, as the official code."},
    )

    def __post_init__(self) -> None:
        check_range("top_k", self.top_k, 1, None)
        if self.prototype_examples is not None:
            check_range("prototype_examples", self.prototype_examples, 1, None)


@register_method
class ConDU(ContinualMethod[ConDUConfig]):
    """ConDU (ICLR 2026): each task fine-tuned from θ0, task vectors fused into one unified vector with a mask and a
    rescaler per task, decoupled task experts and prototype-based semantic voting at inference (module docstring)."""

    name = NAME
    config_class = ConDUConfig
    same_step_as = "finetune"  # a plain fine-tuning step: the fusion is task-end work
    fsdp_refusal = ("its experts are a module attached to the model, which the plain model the loop gathers after "
                    "each task would not carry")
    roles = {
        "task_vector_fusion": "fine-tunes every task from the model before the first task and deploys that model "
                              "with its fused task experts",
    }
    conflicts = {
        "task_vector_fusion": "fuses the task vectors of each task itself: use one such method",
        "parameter_efficient": "fuses task vectors of the model's own parameters, whose modules a "
                               "parameter-efficient method changes during each task",
        "weight_interpolation": "deploys the model before the first task with its experts, not an interpolation",
        "fresh_model": "fine-tunes every task from the model before the first task, not from a fresh one",
        "vocabulary": "fuses task vectors of equal shapes: a grown vocabulary changes the embedding's",
        "class_scorer": "the evaluator scores a ConDU model through its experts' ensemble, which would ignore "
                        "another method's class scorer",
    }
    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_condu_model",
        keeps="its unified task vector, per-task triggers (masks, rescalers) and class prototypes",
        plain_model="the model before the first task (ConDU's θ0, without the experts)")

    def __init__(self, config: ConDUConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.store = ExpertStore()

    def check_stream(self, stream: TaskStream) -> None:
        """Every task must be a classification task: prototypes and scores are per class."""
        for task in stream.tasks:
            if not task.kind_spec.has_classes or not task.class_names:
                raise ValueError(f"{NAME} scores tasks by their classes (its prototypes are class means): task "
                                 f"{task.name!r} is a {task.kind} task; use a stream of classification tasks")

    def on_task_start(self, context: TaskContext) -> None:
        """Take θ0 at the first task (the model every task fine-tunes from; the model holds it again after each task)
        and attach the experts so that the evaluator scores through them."""
        model = context.model
        if self.store.initial is None:
            self.store.initial = float_parameters(model)
        else:
            params = dict(unwrap(model).named_parameters())
            for name, value in self.store.initial.items():
                if name not in params or params[name].shape != value.shape:
                    raise ValueError(f"{NAME}: the model's parameter {name!r} is not θ0's (shape "
                                     f"{tuple(value.shape)}): every task must fine-tune the same architecture")
        attach_experts(model, self.store, self.config)

    def after_training(self, context: TaskContext) -> None:
        """δ_t = θ_t − θ0; decouple the earlier experts and unify them with δ_t; put θ0 back into the model; compute
        the task's prototypes with θ0."""
        store, model = self.store, context.model
        if store.initial is None:
            raise ValueError(f"{NAME}: no θ0 (on_task_start did not run for this task)")
        trained = float_parameters(model)
        delta = {name: trained[name] - value for name, value in store.initial.items()}
        experts = [store.expert(index) for index in range(len(store.tasks))]
        store.unified, store.masks, rescalers = unify([*experts, delta])
        store.rescalers = rescalers.tolist()
        params = dict(unwrap(model).named_parameters())
        with torch.no_grad():
            for name, value in store.initial.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
        store.prototypes.append(task_prototypes(context, self.config.prototype_examples).cpu())
        store.tasks.append(context.task.name)
        attach_experts(model, store, self.config)
        logger.info("%s, task %d (%s): %d experts fused; rescalers %s", NAME, context.task_index, context.task.name,
                    len(store.tasks), [round(value, 4) for value in store.rescalers])

    def state_dict(self) -> dict[str, Any]:
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state)


def task_prototypes(context: TaskContext, max_examples: int | None) -> torch.Tensor:
    """The current task's class prototypes with the model as it is (θ0): its training images (all, or a seeded subset
    of `max_examples`) and its classes' template prompts (`eval_templates`, else the default)."""
    from ..data.streaming import is_streaming

    task, model = context.task, context.model
    if context.image_processor is None or context.tokenizer is None:
        raise ValueError(f"{NAME} computes prototypes with the run's image processor and tokenizer (set by the loop)")
    names, templates = list(task.class_names or []), list(task.eval_templates or DEFAULT_TEMPLATES)
    dataset: Any = task.train
    if is_streaming(dataset):
        rows = list(dataset if max_examples is None else dataset.take(max_examples))
    else:
        indices = list(range(len(dataset)))
        if max_examples is not None and len(indices) > max_examples:
            generator = torch.Generator().manual_seed(int(context.seed))
            indices = sorted(torch.randperm(len(indices), generator=generator)[:max_examples].tolist())
        rows = [dataset[index] for index in indices]
    if not rows:
        raise ValueError(f"{NAME}: task {task.name!r} has no training images for its prototypes")
    batch_size = max(int(context.eval_batch_size or 64), 1)
    images = encode_images(model, context.image_processor, (row["image"] for row in rows), batch_size=batch_size,
                           where_prefix=f"{task.name}/train")
    labels = torch.tensor([int(row["label"]) for row in rows])
    prompts = [format_template(template, name) for name in names for template in templates]
    texts = encode_texts(model, context.tokenizer, prompts, batch_size=batch_size, max_length=context.max_length)
    text_means = nn.functional.normalize(texts.float(), dim=-1).reshape(len(names), len(templates), -1).mean(dim=1)
    return class_prototypes(images, labels, text_means)


# ----------------------------------------------------------------------------------------------------------------
# Inference from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def load_condu_model(name_or_path: str | Path, revision: str | None = None) -> ContinualDualEncoder:
    """A task checkpoint's model (θ0) with its ConDU experts attached (from the method state beside it), in eval mode:
    what the run evaluated. `name_or_path`: a task folder (`output_dir/task-<k>/`) or a Hub repository id with its
    `revision` (`task-<k>`)."""
    method, model = load_checkpoint_method(ConDU, name_or_path, revision)
    attach_experts(model, method.store, method.config)
    return model.eval()
