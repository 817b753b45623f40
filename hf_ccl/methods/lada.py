"""LADA (Luo, Zhou, Wei and Zhang, ICML 2025, "LADA: Scalable Label-Specific CLIP Adapter for Continual Learning",
arXiv 2505.23271; official code github.com/MaolinLuo/LADA, not readable here: see "What could not be read").

**Setting.** X-TAIL and class-incremental classification: task k brings classes C^k; at test time an image is scored
among every class seen so far (and unseen ones) with no task identity and no parameter selection. The image tower
f_I is frozen and LADA sits after it, so no gradient reaches CLIP (`hf_ccl.methods.lada_memory`).

**Text side** (the paper's preliminary framework, Eq. 3-4). Each class c^i_j has a text feature t^i_j; learning task
k updates only t^k_j (those of earlier tasks are frozen). `text_tuning: adaptformer` builds them as the paper does
(its Appendix B): a fresh AdaptFormer on the text tower for each task (`hf_ccl.methods.lada_text`), t^k_j the class's
training-template prompts encoded through it (normalised mean), stored as frozen vectors when the task ends.
`features` (the default: it runs on every family, AltCLIP's and Chinese-CLIP's post-norm text towers included)
trains the vectors t^k_j themselves from the classes' zero-shot embeddings; `none` keeps them zero-shot.

**Label-specific memory.** Each class c holds λ = `num_units` memory units W_c (initialised at the K-means centres of
its training images' normalised features v) and its label-specific features φ_c(v) = [exp(-β(1 - v·w_c(l)))]_l;
the memories of all tasks are concatenated (aggregated across tasks), so every image meets every learned class's
units: inference selects no parameters.

**Scores** (every learned class c, and the evaluator's class embedding e_c for a class never learned):

    s_c(v) = exp(t) cos(v, t_c) + α Σ_l φ_c,l(v)          (learned)        s_c(v) = exp(t) cos(v, e_c)   (unseen)

**Loss of task k** (only task k's t and W train). The current task's cross-entropy among all seen classes, averaged
per class and summed over classes (paper Eq. 3: Σ_j 1/|D^k_j| Σ_{v ∈ D^k_j} ℓ), plus the distillation of every
earlier class (paper Eq. 4), weighted by `distill_weight`:

    L = Σ_j mean_{v ∈ batch ∩ D^k_j} CE(s(v), j)  +  γ Σ_{i<k, j} mean_{z ~ class (i, j)} CE(s(z), (i, j))

where z are, with `distribution: gmm` (the default, the paper's distribution-preserved training), `samples_per_class`
draws per earlier class and step from its Gaussian components {π(l), p(l), Σ(l)} (a component by π, then
p + Σ^½ ε with diagonal Σ, renormalised), and with `distribution: prototypes` its λ prototypes p(l) themselves (the
paper's Eq. 4 on the stored centres). The draws of a step are seeded by the run's seed, the task and the step, so a
resumed run draws the same ones.

**What could not be read.** The paper's full text and its official code were not reachable from this machine (the
stored copies hold the abstract, a review to Eq. 4 and a summary). Read there: the frozen f_I, the text features
with only the new task's trainable, Eq. 3's per-class averaging, Eq. 4 on λ prototypes p^i_j(l) per earlier class,
the cluster-derived memory units W_j^k aggregated across tasks, the Gaussian components {π, p, Σ} of the
distribution-preserved training, no parameter selection at inference. Not read, and chosen here: the form of φ (the
Tip-Adapter affinity exp(-β(1 - v·w)) with the units as keys), how φ enters the score (summed per class, weight α),
diagonal covariances, renormalised draws, the default hyperparameters (λ = 4, α = 1, β = 5.5, γ = 1, AdaptFormer
bottleneck 64 and scale 0.1, its defaults), whether the final method keeps the AdaptFormer text side (read: the
preliminary framework trains it; the summary says no gradient reaches the *image* encoder). No variant of the official code is offered for the same reason.

**Checkpoints.** The memory lives in `model.lada` (`hf_ccl.methods.lada_memory.LADAMemory`) and in the method state;
it is never written to `model.safetensors`, which stays the frozen base model (plain transformers loads the model
without LADA). `load_lada_model(task_folder)` (or a Hub id and `revision`) returns the model the run evaluated.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..validation import ConfigError
from .base import ContinualMethod, MethodConfig, TaskContext
from .lada_memory import ATTRIBUTE, LADAMemory, LADATask, gaussian_components, lada_memory
from .lada_text import ATTRIBUTE as TEXT_ATTRIBUTE
from .lada_text import TextAdaptFormer
from .loading import CheckpointLoader
from .registry import register_method
from .state import load_checkpoint_method
from .trainable import requires_grad_flags, restore_flags

if TYPE_CHECKING:
    from ..data.task import TaskStream
    from ..modeling import ContinualDualEncoder, ContinualDualEncoderOutput

logger = logging.getLogger(__name__)
NAME = "lada"
DISTRIBUTIONS = ("gmm", "prototypes")
TEXT_TUNINGS = ("features", "adaptformer", "none")


@dataclass
class LADAConfig(MethodConfig):
    num_units: int = field(default=4, metadata={"help": "λ: memory units (K-means centres, Gaussian components) per "
                                                        "class; a class with fewer training images gets one per image."})
    alpha: float = field(default=1.0, metadata={"help": "α: weight of the label-specific features in a class's score."})
    beta: float = field(default=5.5, metadata={"help": "β: sharpness of the affinity exp(-β(1 - v·w)) of an image to a "
                                                       "memory unit."})
    distill_weight: float = field(default=1.0, metadata={"help": "γ: weight of the distillation of earlier classes "
                                                                 "(paper Eq. 4); 0 turns it off."})
    distribution: str = field(default="gmm", metadata={"help": "'gmm': distil on draws from each earlier class's "
                                                               "Gaussian components (distribution-preserved training); "
                                                               "'prototypes': on its λ stored centres (Eq. 4)."})
    samples_per_class: int = field(default=4, metadata={"help": "Draws per earlier class and step with "
                                                                "distribution 'gmm'."})
    variance_floor: float = field(default=1e-4, metadata={"help": "Smallest per-dimension variance of a component."})
    kmeans_iterations: int = field(default=20, metadata={"help": "Lloyd iterations of the per-class K-means."})
    text_tuning: str = field(default="features", metadata={"help": "How the new classes' text features train: "
                                                                   "'features' (the vectors themselves, from their "
                                                                   "zero-shot embeddings), 'adaptformer' (the paper's "
                                                                   "Appendix B: a fresh AdaptFormer on the text tower "
                                                                   "per task) or 'none' (kept zero-shot)."})
    text_bottleneck: int = field(default=64, metadata={"help": "Bottleneck of the AdaptFormer ('adaptformer')."})
    text_adapter_scale: float = field(default=0.1, metadata={"help": "Scale s of the AdaptFormer's output "
                                                                     "('adaptformer')."})
    max_per_class: int | None = field(default=None, metadata={"help": "Training images per class the K-means and "
                                                                      "the components are fitted on (a seeded "
                                                                      "subset); None: all."})

    def __post_init__(self) -> None:
        if self.num_units < 1:
            raise ConfigError(f"num_units must be >= 1, got {self.num_units}", "num_units")
        for key in ("alpha", "beta", "distill_weight"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{key} must be a finite number >= 0, got {value}", key)
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(f"distribution must be one of {list(DISTRIBUTIONS)}, got {self.distribution!r}",
                              "distribution")
        if self.samples_per_class < 1:
            raise ConfigError(f"samples_per_class must be >= 1, got {self.samples_per_class}", "samples_per_class")
        if not (math.isfinite(self.variance_floor) and self.variance_floor > 0):
            raise ConfigError(f"variance_floor must be a finite number > 0, got {self.variance_floor}",
                              "variance_floor")
        if self.kmeans_iterations < 1:
            raise ConfigError(f"kmeans_iterations must be >= 1, got {self.kmeans_iterations}", "kmeans_iterations")
        if self.text_tuning not in TEXT_TUNINGS:
            raise ConfigError(f"text_tuning must be one of {list(TEXT_TUNINGS)}, got {self.text_tuning!r}",
                              "text_tuning")
        if self.text_bottleneck < 1:
            raise ConfigError(f"text_bottleneck must be >= 1, got {self.text_bottleneck}", "text_bottleneck")
        if not math.isfinite(self.text_adapter_scale):
            raise ConfigError(f"text_adapter_scale must be finite, got {self.text_adapter_scale}", "text_adapter_scale")
        if self.max_per_class is not None and self.max_per_class < 1:
            raise ConfigError(f"max_per_class must be >= 1 or None, got {self.max_per_class}", "max_per_class")


@register_method
class LADA(ContinualMethod[LADAConfig]):
    """Label-specific memory units after the frozen image tower, text features per class (module docstring)."""

    name = NAME
    config_class = LADAConfig
    replaces_contrastive_loss = True
    roles = {
        "parameter_efficient": "freezes the model and trains only its own text features and memory units",
        "similarity_distillation": "distils earlier classes from their stored feature statistics",
        "class_scorer": "ranks classes at evaluation with its own scores (an EvaluationScorer on the model)",
    }
    conflicts = {
        "parameter_efficient": "freezes the model but for its own parameters: each would freeze the other's",
        "class_scorer": "the evaluator ranks classes with one scorer of the model: two would each ignore the other",
        "training_data": "trains on the task's own rows, its labels being their classes in the task; earlier classes "
                         "are kept by its distillation, not by their rows",
    }
    checkpoint_loader = CheckpointLoader(
        module=__name__, function="load_lada_model", keeps="its label-specific memory (text features, memory units "
        "and Gaussian components of every learned class)",
        plain_model="the frozen base model without the memory (zero-shot scores)")
    fsdp_refusal = ("its memory lives on the model beside the frozen towers, and the plain model the loop gathers after "
                    "each task would not carry it")
    test_options = {"num_units": 2, "samples_per_class": 2}

    def __init__(self, config: LADAConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self._memory: LADAMemory | None = None
        self._state: dict[str, Any] | None = None  # a restored state, loaded at the next task start
        self._flags: dict[str, bool] = {}
        self._step: dict[str, Any] = {}  # what the task's steps read (`prepare`)
        self._task_names: list[str] = []  # the current task's classes (its rows' labels index them)
        self._adapter: TextAdaptFormer | None = None  # the task's AdaptFormer while it trains ('adaptformer')
        self._prompts: Any = None  # the task's class prompts (`ClassPrompts`) the adapter encodes every step

    # ----- checks -------------------------------------------------------------------------------------------
    def check_stream(self, stream: TaskStream) -> None:
        kinds = sorted({task.kind_spec.name for task in stream if not task.kind_spec.has_classes})
        if kinds:
            raise ValueError(f"lada learns classes (label-specific memory units per class); the stream has tasks of "
                             f"kind {kinds}, which have none: use a classification stream")
        from ..data.streaming import is_streaming

        streamed = [task.name for task in stream if is_streaming(task.train)]
        if streamed:
            raise ValueError(f"lada fits each class's memory on its task's training images before the task trains; "
                             f"tasks {streamed} are streamed (IterableDataset): give them as map-style datasets")

    def check_model(self, model: torch.nn.Module) -> None:
        """`text_tuning: adaptformer` needs CLIP-style pre-norm text layers (refused on AltCLIP, Chinese-CLIP)."""
        if self.config.text_tuning == "adaptformer":
            from .moe_adapters import check_layers

            try:
                check_layers(model, ["text"])
            except ValueError as error:
                raise ConfigError(f"method_args.lada.text_tuning=adaptformer: {error}; use text_tuning: features",
                                  "method_args.lada.text_tuning") from None

    # ----- task start: the new classes' memory ---------------------------------------------------------------
    def on_task_start(self, context: TaskContext) -> None:
        """Attach the memory (first task, or the first after a restore), then add this task's classes: their
        text features (zero-shot) and memory units and components (K-means of their training images)."""
        model = context.model
        memory = lada_memory(model)
        if memory is None:
            self.check_model(model)
            self._flags = requires_grad_flags(model)
            memory = LADAMemory(self.config.alpha, self.config.beta, float(model.logit_scale.detach().exp()))
            memory.to(model.logit_scale.device)
            setattr(model, ATTRIBUTE, memory)
        else:
            self._flags = {k: v for k, v in requires_grad_flags(model).items()
                           if not k.startswith((ATTRIBUTE + ".", TEXT_ATTRIBUTE + "."))}
        if self._state is not None:
            self._load_into(memory, self._state)
            self._state = None
        self._memory = memory
        if len(memory.tasks) > context.task_index:
            raise ValueError(f"{NAME}: the memory holds {len(memory.tasks)} tasks at the start of task "
                             f"{context.task_index}")
        _ignore_on_save(model)
        self._task_names = list(context.task.class_names or [])
        names, task = self.new_task(context)
        memory.add_task(names, task.to(model.logit_scale.device))
        _ignore_on_save(model)
        model.requires_grad_(False)
        task.memory.requires_grad_(True)
        task.text.requires_grad_(self.config.text_tuning == "features")
        if self.config.text_tuning == "adaptformer":
            self.install_text_adapter(context)
        self.prepare(memory)

    @torch.no_grad()
    def new_task(self, context: TaskContext) -> tuple[list[str], LADATask]:
        """The classes this task learns (those with training images) and their `LADATask`, from their training
        images (frozen image tower) and their prompts. A class without a training image is not learned: it is
        scored zero-shot, as a class never seen (logged)."""
        task = context.task
        names = list(task.class_names or [])
        features, labels = task_features(context, self.config.max_per_class)
        generator = torch.Generator().manual_seed(int(context.seed) * 1000 + context.task_index)
        parts: dict[str, list[torch.Tensor]] = {"weights": [], "means": [], "variances": [], "valid": []}
        present = []
        for index in range(len(names)):
            rows = features[labels == index]
            if rows.shape[0] == 0:
                continue
            present.append(index)
            for key, value in gaussian_components(rows, self.config.num_units, self.config.kmeans_iterations,
                                                  generator, self.config.variance_floor).items():
                parts[key].append(value)
        absent = [name for index, name in enumerate(names) if index not in present]
        if absent:
            logger.warning("%s, task %d (%s): classes %s have no training image and are not learned (scored "
                           "zero-shot)", NAME, context.task_index, task.name, absent)
        if not present:
            raise ValueError(f"{NAME}: task {context.task_index} ({task.name!r}) has no training image of any class")
        stats = {key: torch.stack(values) for key, values in parts.items()}
        text = zero_shot_text(context)[torch.tensor(present)]
        memory = F.normalize(stats["means"], dim=-1) * stats["valid"].unsqueeze(-1)
        return [names[index] for index in present], LADATask(text, memory, stats["weights"], stats["means"],
                                                               stats["variances"], stats["valid"])

    def install_text_adapter(self, context: TaskContext) -> None:
        """A fresh AdaptFormer on the text tower for this task (seeded), and the task's class prompts it encodes."""
        from ..class_prompts import ClassPrompts

        model = context.model
        generator = torch.Generator().manual_seed(int(context.seed) * 1000 + context.task_index)
        adapter = TextAdaptFormer(model, self.config.text_bottleneck, self.config.text_adapter_scale, generator)
        adapter.to(device=model.logit_scale.device, dtype=model.logit_scale.dtype)
        adapter.install()
        setattr(model, TEXT_ATTRIBUTE, adapter)
        adapter.requires_grad_(True)
        self._adapter = adapter
        self._prompts = ClassPrompts.build([context.task], context.tokenizer, scope="task",
                                           max_length=context.max_length or model.max_text_positions,
                                           padding=model.text_padding)
        _ignore_on_save(model)

    def collator_options(self, context: TaskContext) -> dict[str, Any]:
        """Each row's class index in its task, as the batch's `class_labels`."""
        return {"class_labels": row_labels}

    # ----- the loss ---------------------------------------------------------------------------------------------
    def prepare(self, memory: LADAMemory) -> None:
        """What every step of the task reads, on the memory's device, once per task (no host copy per step): the
        seen classes (the loss's columns), the current classes' columns, the earlier classes' components."""
        device = memory.logit_scale.device
        seen = memory.seen_names()
        column = {name: index for index, name in enumerate(seen)}
        current = memory.class_names[-1]
        earlier = [name for name in seen if name not in set(current)]
        where = memory.learned()
        tasks = [memory.task(k) for k, _ in (where[name] for name in earlier)]
        rows = [row for _, row in (where[name] for name in earlier)]
        stats = {key: torch.stack([getattr(task, key)[row] for task, row in zip(tasks, rows, strict=True)])
                 for key in ("weights", "means", "variances", "valid")} if earlier else {}
        self._step = {"seen": seen,
                      "current": torch.tensor([column[name] for name in current], dtype=torch.long).to(device),
                      # each row label (its class in the task) -> its column; a class the task does not learn (no
                      # training image) has no row
                      "labels": torch.tensor([column.get(name, 0) for name in self._task_names or current],
                                             dtype=torch.long).to(device),
                      "earlier": torch.tensor([column[name] for name in earlier], dtype=torch.long).to(device),
                      **{key: value.detach().clone().to(device) for key, value in stats.items()}}
        if self._prompts is not None:  # the AdaptFormer encodes every class of the task: the learned ones' rows
            prompt_row = {name: index for index, name in enumerate(self._prompts.class_names)}
            self._step["prompt_rows"] = torch.tensor([prompt_row[name] for name in current],
                                                     dtype=torch.long).to(device)
        if earlier and self.config.distribution == "prototypes":
            index = stats["valid"].nonzero()
            self._step["prototypes"] = F.normalize(stats["means"][index[:, 0], index[:, 1]].float(), dim=-1).to(device)
            self._step["prototype_columns"] = self._step["earlier"][index[:, 0].to(device)]

    def loss_terms(self, model: ContinualDualEncoder, inputs: dict[str, torch.Tensor],
                   outputs: ContinualDualEncoderOutput, context: TaskContext) -> dict[str, torch.Tensor]:
        """`current`: paper Eq. 3 on the batch; `distill`: Eq. 4 on the earlier classes (module docstring)."""
        memory = self._require_memory()
        if "class_labels" not in inputs:
            raise ValueError(f"{NAME} needs each row's class (`class_labels`, from its collator option)")
        if outputs.image_embeds is None:
            raise ValueError(f"{NAME} scores the batch's image embeddings; the model's outputs have none")
        step, seen = self._step, self._step["seen"]
        images = outputs.image_embeds.detach().float()
        targets = step["labels"][inputs["class_labels"]]
        current = None  # with the AdaptFormer: the current classes' text features, encoded through it
        if self._adapter is not None:
            current = (step["current"], self._prompts.class_embeddings(model).float()[step["prompt_rows"]])
        terms = {"current": class_balanced_cross_entropy(memory.learned_scores(images, seen, current), targets,
                                                         len(seen))}
        if len(step["earlier"]) and self.config.distill_weight > 0:
            samples, columns = self.distillation_samples(context)
            scores = memory.learned_scores(samples, seen, current)
            terms["distill"] = self.config.distill_weight * class_balanced_cross_entropy(scores, columns, len(seen))
        return terms

    def distillation_samples(self, context: TaskContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Features of the earlier classes and their loss columns: their prototypes (`prototypes`) or
        `samples_per_class` draws each from their components (`gmm`), seeded by the run's seed, the task and the
        step (a resumed run draws the same)."""
        step = self._step
        if self.config.distribution == "prototypes":
            return step["prototypes"], step["prototype_columns"]
        weights, means, variances = step["weights"], step["means"], step["variances"]
        classes, draws = means.shape[0], self.config.samples_per_class
        seed = (int(context.seed) * 1_000_003 + context.task_index) * 1_000_003 + int(context.global_step)
        generator = torch.Generator(device=means.device)
        generator.manual_seed(seed % (2**63))
        component = torch.multinomial(weights.float(), draws, replacement=True, generator=generator)  # [C, S]
        rows = torch.arange(classes, device=means.device).unsqueeze(1).expand(-1, draws)
        noise = torch.randn(classes, draws, means.shape[-1], generator=generator, device=means.device)
        samples = means[rows, component].float() + variances[rows, component].float().sqrt() * noise
        columns = step["earlier"].unsqueeze(1).expand(-1, draws)
        return F.normalize(samples.reshape(-1, means.shape[-1]), dim=-1), columns.reshape(-1)

    # ----- task end --------------------------------------------------------------------------------------------
    def after_training(self, context: TaskContext) -> None:
        """The task's parameters are frozen from now on; the base parameters get their flags back."""
        memory = self._require_memory()
        if self._adapter is not None:  # the task's text features are what its AdaptFormer makes of its prompts
            model = context.model
            was_training = model.training
            model.eval()
            with torch.no_grad():
                embeddings = self._prompts.class_embeddings(model).float()[self._step["prompt_rows"]]
                memory.task(len(memory.tasks) - 1).text.copy_(embeddings)
            model.train(was_training)
            self._adapter.remove()
            delattr(model, TEXT_ATTRIBUTE)
            self._adapter = self._prompts = None
        for param in memory.parameters():
            param.requires_grad_(False)
        restore_flags(context.model, self._flags)
        _ignore_on_save(context.model)

    # ----- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every task's class names and tensors (the task in progress too, mid-task)."""
        memory = self._memory
        if memory is None:
            return dict(self._state) if self._state is not None else {}
        state: dict[str, Any] = {
            "class_names": [list(names) for names in memory.class_names], "logit_scale": float(memory.logit_scale),
            "tasks": {str(k): {key: value.detach().clone() for key, value in task.state_dict().items()}
                      for k, task in enumerate(memory.tasks)}}
        if self._adapter is not None:  # mid-task: the AdaptFormer being trained
            state["text_adapter"] = {key: value.detach().clone() for key, value in self._adapter.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`: in place into the attached memory (a task resumed from a Trainer checkpoint: the
        optimizer refers to its parameters), else at the next task start."""
        if not state:
            return
        if self._memory is not None:
            self._load_into(self._memory, state)
            if "text_adapter" in state:
                if self._adapter is None:
                    raise ValueError(f"{NAME}: a mid-task state with a text adapter can only be loaded into the task "
                                     "that wrote it")
                with torch.no_grad():
                    self._adapter.load_state_dict(state["text_adapter"])
            if self._step:
                self.prepare(self._memory)
        else:
            self._state = dict(state)

    def _load_into(self, memory: LADAMemory, state: dict[str, Any]) -> None:
        names = [list(names) for names in state["class_names"]]
        tensors = state["tasks"]
        if len(names) < len(memory.tasks):
            raise ValueError(f"{NAME}: a state of {len(names)} tasks cannot be loaded into a memory of "
                             f"{len(memory.tasks)}")
        device = memory.logit_scale.device
        with torch.no_grad():
            memory.logit_scale.fill_(float(state["logit_scale"]))
            for k, task_names in enumerate(names):
                values = tensors[str(k)]
                if k < len(memory.tasks):
                    if memory.class_names[k] != task_names:
                        raise ValueError(f"{NAME}: the state's task {k} has other classes than the memory's")
                    memory.task(k).load_state_dict(values)
                else:
                    classes, units, dim = values["memory"].shape
                    task = LADATask.empty(classes, units, dim).to(device)
                    task.load_state_dict(values)
                    task.requires_grad_(False)
                    memory.add_task(task_names, task)

    def _require_memory(self) -> LADAMemory:
        if self._memory is None:
            raise ValueError(f"{NAME} has no memory: on_task_start attaches it")
        return self._memory


# ----------------------------------------------------------------------------------------------------------------
# Pieces (pure functions; the tests check each by hand)
# ----------------------------------------------------------------------------------------------------------------
def row_labels(texts: Any, labels: Any) -> list[int]:
    """`CLIPCollator`'s `class_labels`: each row's `label` (its class's index in its own task)."""
    if any(label is None or int(label) < 0 for label in labels):
        raise ValueError(f"{NAME} trains classification rows: every row needs its class `label`")
    return [int(label) for label in labels]


def class_balanced_cross_entropy(scores: torch.Tensor, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Σ_j mean_{rows of class j} CE(scores[row], j) over the classes present (paper Eq. 3's per-class average):
    each row's loss divided by its class's row count."""
    losses = F.cross_entropy(scores.float(), targets, reduction="none")
    counts = torch.zeros(num_classes, device=losses.device).index_add(0, targets, torch.ones_like(losses))
    return (losses / counts[targets]).sum()


@torch.no_grad()
def task_features(context: TaskContext, max_per_class: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised image embeddings (frozen image tower) of the task's training images and their labels: all of them,
    or a seeded subset of at most `max_per_class` per class (CPU, float32)."""
    from ..data.task import CollatorSetup

    model, dataset = context.model, context.task.train
    _, collator = context.task.kind_spec.collators(context.task, CollatorSetup(
        context.image_processor, context.tokenizer, context.max_length or model.max_text_positions, context.seed,
        padding=model.text_padding))
    all_labels = torch.tensor(row_labels(None, list(dataset["label"])), dtype=torch.long)
    indices = list(range(len(dataset)))
    if max_per_class is not None:
        generator = torch.Generator().manual_seed(int(context.seed))
        order = torch.randperm(len(indices), generator=generator).tolist()
        taken: dict[int, int] = {}
        indices = []
        for index in order:
            label = int(all_labels[index])
            if taken.get(label, 0) < max_per_class:
                taken[label] = taken.get(label, 0) + 1
                indices.append(index)
        indices.sort()
    device = model.logit_scale.device
    batch_size = max(int(context.eval_batch_size or 64), 1)
    parts = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(indices), batch_size):
            rows = [dataset[int(i)] for i in indices[start:start + batch_size]]
            parts.append(model.embed_images(**model.image_inputs(collator(rows), device=device)).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(parts), all_labels[torch.tensor(indices, dtype=torch.long)]


@torch.no_grad()
def zero_shot_text(context: TaskContext) -> torch.Tensor:
    """The task's class embeddings (normalised means of their normalised training-prompt embeddings), CPU float32."""
    from ..class_prompts import ClassPrompts

    model = context.model
    prompts = ClassPrompts.build([context.task], context.tokenizer, scope="task",
                                 max_length=context.max_length or model.max_text_positions,
                                 padding=model.text_padding)
    was_training = model.training
    model.eval()
    try:
        return prompts.class_embeddings(model).float().cpu()
    finally:
        model.train(was_training)


def _ignore_on_save(model: torch.nn.Module) -> None:
    """Keep every `lada.` and `lada_text.` key out of `save_pretrained` (transformers' `_keys_to_ignore_on_save`)."""
    ignored = {key for key in (getattr(model, "_keys_to_ignore_on_save", None) or ())
               if not key.startswith((ATTRIBUTE + ".", TEXT_ATTRIBUTE + "."))}
    for attribute in (ATTRIBUTE, TEXT_ATTRIBUTE):
        module = getattr(model, attribute, None)
        if isinstance(module, torch.nn.Module):
            ignored |= {f"{attribute}.{key}" for key in module.state_dict()}
    setattr(model, "_keys_to_ignore_on_save", ignored)  # noqa: B010


# ----------------------------------------------------------------------------------------------------------------
# Inference from a checkpoint
# ----------------------------------------------------------------------------------------------------------------
def load_lada_model(name_or_path: str | Path, revision: str | None = None) -> ContinualDualEncoder:
    """A task checkpoint's model with its LADA memory attached (from the method state beside it), in eval mode: what
    the run evaluated. `name_or_path`: a task folder (`output_dir/task-<k>/`) or a Hub repository id with its
    `revision` (`task-<k>`). The checkpoint's weights alone are the frozen base model."""
    method, model = load_checkpoint_method(LADA, name_or_path, revision)
    memory = LADAMemory(method.config.alpha, method.config.beta, 1.0).to(model.logit_scale.device)
    method._load_into(memory, method._state or {"class_names": [], "logit_scale": 1.0, "tasks": {}})
    memory.requires_grad_(False)
    setattr(model, ATTRIBUTE, memory)
    _ignore_on_save(model)
    return model.eval()
