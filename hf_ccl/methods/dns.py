"""DNS, Dual-sided Null Space projection (Liu, Xia, Ng, Chua, "Continual Multimodal Contrastive Learning",
arXiv 2503.14963, NeurIPS 2025), on chosen linear layers of a CLIP or on CMCL's per-modality learner heads.
Spec: specs/cmcl.md §2 and §7.

For each projected `nn.Linear` (weight W [d_out, d_in], y = W x) the gradient G = ∇W is replaced, after clipping and
before the optimizer step, by (Thm. 4, Eq. 8 = Eqs. 36/55; spec §2.3 and A1)

    ΔW = G − P_out G P_in,

- P_in [d_in, d_in], on the RIGHT: the range projector of the uncentered covariance of the layer's OWN inputs on
  all earlier tasks (the paper's P', P);
- P_out [d_out, d_out], on the LEFT: the range projector of the covariance of its PARTNER's outputs on all
  earlier tasks (the paper's P̃, P̃'; each storage decays itself and adds the partner's new outputs, A2).

The old alignment z'ᵀ W x of every earlier pair then moves only at second order in the step size (spec §2.2).
One implementation, two settings:

- A full CLIP: the layers are the `layers` patterns (default `visual_projection`, `text_projection`), each with the
  fixed partner of `partners` (the two projections are each other's: `visual_projection`'s P_out comes from the
  text embeddings). A layer without a partner is projected one-sided, ΔW = G (I − P_in) (Adam-NSCL's rule).
- Learner heads (pair tasks with the `learner_heads` method, the paper's own setting, spec §2.1, §2.5): the layers
  are the heads `learner_heads.heads.<modality>` (all of them by default; `layers` patterns pick some). On the task
  of pair (a, b) head a's partner is head b and head b's is head a, so C_out[m] mixes the outputs of every partner
  of m over every earlier task m took part in (§2.3 "any pair"). Only the pair's heads are projected; a head never
  seen before trains unprojected while its seen partner is projected (A15). List `dns` after `learner_heads`.

`variant="one_sided"` projects every layer G (I − P_in): what the official code effectively runs (its output-side
threshold 0 keeps the numerically-zero eigenvalues, so P_out ≈ I; A3). `preset="official"` is the released code's
setting: output threshold 0 and one global count (A3, A5); its heads' bias is `learner_heads`' `bias` option.

Covariances (Alg. 1 l.16–18, Thm. 8; spec §2.3, A2, A6, A17): at the end of each task, one no-grad, eval-mode pass
over the task's training data (for a pair task its cached features z*, which the heads map to W z*; the same batches
on every process, dealt round-robin, sums reduced with `all_reduce_sum_`; see `regularization.task_batches`)
collects, through forward hooks, each layer's inputs x and its bias-free outputs W x with the weights just trained.
They are merged into running means C ← (n̄/(n̄+n)) C + (1/(n̄+n)) Σ x xᵀ, n̄ counted per layer (per modality, A5) or,
with `counts="global"`, once over the stream (the official code). A layer whose module did not run in a task gets
no covariance update (A15). The covariances are the method's state; the projectors are rebuilt from them at every
task start (Alg. 1 l.4–7) and fixed for the task.

Thresholds (spec §3, A3, A4): eigenvalues above `threshold_in` / `threshold_out` span the protected subspaces,
absolute by default (the paper's λ_min: 0.01 for ImageBind, the default on a CLIP's layers; 1e-4 for LanguageBind's
unit-norm features, the default on learner heads, whose cached features are unit-norm), or relative to the largest
eigenvalue (`threshold_mode="relative"`). Threshold 0 on a full-rank covariance gives P = I.

Optimizer (spec §2.4, A7): with AdamW the realised update is G's projection rescaled element-wise by 1/(√v + ε),
plus an unprojected decoupled weight decay, so the guarantee holds only for plain SGD. `project="update"` projects the
gradient AND the update the optimizer actually made: W is remembered before `optimizer.step()` and set to
W_old + proj(W_new − W_old) right after it (`post_optimizer_step`), which is exact at first order whatever the
optimizer and weight decay. With `freeze_others=True` only the projected layers' weights train.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..data.task import ModelPart
from ..distributed import all_reduce_sum_
from .base import ContinualMethod, MethodConfig, TaskContext, pair_modalities
from .projection import (
    THRESHOLD_MODES,
    dual_null_space_projection,
    merge_second_moment,
    null_space_projector,
    second_moment,
)
from .registry import register_method
from .regularization import task_batches
from .trainable import freeze_base, requires_grad_flags, restore_flags

if TYPE_CHECKING:
    from ..data.task import Task
    from ..modeling import ContinualDualEncoder

logger = logging.getLogger(__name__)

VARIANTS = ("paper", "one_sided")
PROJECT_MODES = ("gradient", "update")
COUNT_RULES = ("per_modality", "global")
PRESETS = ("paper", "official")
CLIP_LAYERS = ("visual_projection", "text_projection")
DEFAULT_PARTNERS = {"visual_projection": "text_projection", "text_projection": "visual_projection"}
#: Module-name prefix of the learner heads (`model.learner_heads.heads[<modality>]`, `hf_ccl.heads`).
HEADS_PREFIX = "learner_heads.heads."
#: λ_min of both sides when left unset: the paper's ImageBind value on a CLIP's layers, its LanguageBind value
#: (unit-norm features, as the cached pair features are) on learner heads (spec §3, A4).
DEFAULT_THRESHOLDS = {"clip": 0.01, "heads": 1e-4}

#: {layer: (Σ x xᵀ, Σ (Wx)(Wx)ᵀ, rows)} of one covariance pass.
Grams = dict[str, tuple[torch.Tensor, torch.Tensor, int]]


@dataclass
class DNSConfig(MethodConfig):
    layers: list[str] | None = field(
        default=None,
        metadata={
            "help": "fnmatch patterns over module names of the nn.Linear layers to project (spec §2.6). None: "
            "visual_projection and text_projection on a CLIP, every learner head (learner_heads.heads.*) when the "
            "model has learner heads (pair tasks)."
        },
    )
    partners: dict[str, str] = field(
        default_factory=lambda: dict(DEFAULT_PARTNERS),
        metadata={
            "help": "CLIP layer -> partner layer whose outputs give the left (output-side) projector (Thm. 4). "
            "Layers without a partner are projected one-sided, G (I - P_in). Learner heads are partnered by the "
            "task's pair."
        },
    )
    threshold_in: float | None = field(
        default=None,
        metadata={"help": "λ_min of the input-side (right) projector; None: 0.01 on a CLIP (paper, ImageBind), "
                          "1e-4 on learner heads (paper, LanguageBind's unit-norm features)."},
    )
    threshold_out: float | None = field(
        default=None,
        metadata={"help": "λ_min of the output-side (left) projector (spec A3: the paper's single λ_min); None: "
                          "as threshold_in's default."},
    )
    threshold_mode: str = field(
        default="absolute",
        metadata={"help": "'absolute': keep eigenvalues > λ_min (paper); 'relative': keep λ/λ_max > λ_min (A4)."},
    )
    variant: str = field(
        default="paper",
        metadata={
            "help": "'paper': dual-sided G - P_out G P_in (Eq. 8); 'one_sided': G (I - P_in), what the official "
            "code effectively runs (P_out ≈ I, spec A3)."
        },
    )
    project: str = field(
        default="gradient",
        metadata={
            "help": "'gradient': project p.grad before the step (paper); 'update': also project the update the "
            "optimizer made, W_old + proj(W_new - W_old), exact at first order under AdamW (spec A7)."
        },
    )
    counts: str = field(
        default="per_modality",
        metadata={"help": "Running-mean normaliser n̄: 'per_modality' (each layer or head its own, paper) or "
                          "'global' (one count over the stream, the official code; A5)."},
    )
    preset: str = field(
        default="paper",
        metadata={"help": "'official': the released code's behaviour, threshold_out=0 and counts='global' (A3, A5)."},
    )
    freeze_others: bool = field(
        default=False,
        metadata={"help": "Train only the projected layers' weights during each task (the paper trains only learners)."},
    )
    covariance_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size of the task-end covariance pass; None: the task's per-device batch size."},
    )
    covariance_max_batches: int | None = field(
        default=None,
        metadata={"help": "Batches in the covariance pass (a seeded subset); None: the whole task (paper)."},
    )

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = [str(pattern) for pattern in self.layers]
            if not self.layers:
                raise ValueError("dns needs at least one layer pattern (or layers: null for the default)")
        self.partners = {str(k): str(v) for k, v in dict(self.partners).items()}
        for name in ("threshold_in", "threshold_out"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        checks = (("threshold_mode", THRESHOLD_MODES), ("variant", VARIANTS), ("project", PROJECT_MODES),
                  ("counts", COUNT_RULES), ("preset", PRESETS))
        for name, valid in checks:
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        for name in ("covariance_batch_size", "covariance_max_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        if self.preset == "official":
            self.threshold_out, self.counts = 0.0, "global"


def match_linears(linears: Mapping[str, nn.Linear], patterns: Iterable[str], examples: str) -> dict[str, nn.Linear]:
    """The entries of `linears` whose names match any fnmatch pattern, in order; a pattern matching none is an error
    (naming `examples` of valid names)."""
    patterns = list(patterns)
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in linears)]
    if unused:
        raise ValueError(f"dns layer pattern(s) {unused} match no nn.Linear of the model (e.g. {examples})")
    return {name: m for name, m in linears.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def linear_layers(model: nn.Module, patterns: Iterable[str]) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules whose names match any fnmatch pattern, in `named_modules` order; a pattern that
    matches no linear layer is an error."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return match_linears(linears, patterns, "'visual_projection', 'text_model.encoder.layers.*.mlp.fc2'")


def head_layers(model: ContinualDualEncoder, patterns: Iterable[str] | None) -> dict[str, nn.Linear]:
    """The learner heads (`learner_heads.heads.<modality>`) whose names match the patterns (None: all)."""
    heads = {f"{HEADS_PREFIX}{modality}": cast(nn.Linear, head)
             for modality, head in model.require_learner_heads().heads.items()}
    examples = f"{sorted(heads)[:2]} on a model with learner heads; CLIP's own layers are frozen on pair tasks"
    return match_linears(heads, patterns or [f"{HEADS_PREFIX}*"], examples)


def has_learner_heads(model: nn.Module) -> bool:
    return getattr(model, "learner_heads", None) is not None


def is_head(layer: str) -> bool:
    return layer.startswith(HEADS_PREFIX)


def _removed_fraction(matrix: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
    """‖M − proj(M)‖_F / ‖M‖_F (0 when M = 0), on the device (no host sync)."""
    norm = matrix.float().norm()
    removed = (matrix.float() - projected.float()).norm()
    return torch.where(norm > 0, removed / norm.clamp_min(torch.finfo(norm.dtype).tiny), 0.0).detach()


def run_batch(model: ContinualDualEncoder, batch: dict[str, Any]) -> None:
    """One forward of a collated batch through the layers it feeds: a pair batch of cached features through the
    learner heads (`ContinualDualEncoder.forward`), images and texts through the towers (unnormalised)."""
    if "features_a" in batch:
        model(**batch, return_loss=False)
        return
    if "pixel_values" in batch:
        model.embed_images(**model.image_inputs(batch), normalize=False)
    if "input_ids" in batch:
        model.embed_texts(batch["input_ids"], batch.get("attention_mask"), normalize=False)


@register_method
class DNS(ContinualMethod[DNSConfig]):
    """Dual-sided null-space gradient projection (Thm. 4, Eq. 8) on chosen linear layers of a CLIP or on the
    learner heads. See the module docstring."""

    fsdp_refusal = ("its null-space projection multiplies the student's gradients by whole projectors at every step, and "
                    "FSDP2 holds the gradients as shards")
    name = "dns"
    test_families = ("chinese_clip",)
    config_class = DNSConfig
    trains_pair_tasks = True  # on pair tasks: the learner heads, partnered by the task's pair
    roles = {"previous_model": "projects each update out of the feature subspaces of the previous tasks"}
    runs_after = {"learner_heads": "projects the gradients of the heads learner_heads attaches at task start, so "
                  "it runs second (methods [learner_heads, dns])"}

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        #: Running covariances by layer: {"in": C_in [d_in, d_in], "out": C_out [d_out, d_out]} (float64, CPU).
        self.covariances: dict[str, dict[str, torch.Tensor]] = {}
        #: Rows behind each running covariance: {"in": n̄_in, "out": n̄_out}.
        self.counts: dict[str, dict[str, int]] = {}
        #: Rows of every covariance pass so far, the one n̄ of `counts="global"` (A5).
        self.global_count = 0
        self.tasks_seen = 0
        #: This task's projectors by layer: (P_out or None for identity, P_in), float64 on CPU.
        self.projectors: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.ranks: dict[str, dict[str, int]] = {}
        self._device_projectors: dict[tuple[str, torch.device, torch.dtype], tuple] = {}
        self._before_step: dict[str, torch.Tensor] = {}
        self._removed: dict[str, torch.Tensor] = {}  # on the device: read back only when the trainer logs
        self._update_removed: dict[str, torch.Tensor] = {}
        self._flags: dict[str, bool] | None = None

    # ----- layers and partners -----------------------------------------------------------------------------------
    def layer_partners(self, model: ContinualDualEncoder, task: Task | None) -> dict[str, str | None]:
        """This task's projected layers, each with the layer whose outputs give its P_out (None: one-sided): the
        `layers` of a CLIP with their fixed `partners`, or the current pair's heads, each the other's partner."""
        partners: dict[str, str | None]
        if has_learner_heads(model):
            partners = dict(self._head_partners(model, task))
        else:
            layers = linear_layers(model, self.config.layers or CLIP_LAYERS)
            partners = {layer: self.config.partners.get(layer) for layer in layers}
        if self.config.variant == "one_sided":
            return dict.fromkeys(partners)
        return partners

    def _head_partners(self, model: ContinualDualEncoder, task: Task | None) -> dict[str, str]:
        """The chosen heads of the task's pair (a, b): {head a: head b, head b: head a} (spec §2.3 "any pair")."""
        if task is None or task.kind_spec.trains is not ModelPart.LEARNER_HEADS:
            kind = None if task is None else task.kind
            raise ValueError(f"dns on learner heads projects pair tasks (which train learner heads), got a task of "
                             f"kind {kind!r}")
        chosen = head_layers(model, self.config.layers)
        head_a, head_b = (f"{HEADS_PREFIX}{modality}" for modality in pair_modalities(task))
        return {layer: partner for layer, partner in ((head_a, head_b), (head_b, head_a)) if layer in chosen}

    def _dual(self, layer: str) -> bool:
        """Whether `layer` gets a left projector P_out (heads always have a partner; CLIP layers if listed)."""
        return self.config.variant != "one_sided" and (is_head(layer) or layer in self.config.partners)

    def thresholds(self, layer: str) -> tuple[float, float]:
        """(λ_in, λ_out) of `layer`: the configured ones, or the setting's default (`DEFAULT_THRESHOLDS`)."""
        default = DEFAULT_THRESHOLDS["heads" if is_head(layer) else "clip"]
        config = self.config
        return (default if config.threshold_in is None else config.threshold_in,
                default if config.threshold_out is None else config.threshold_out)

    # ----- projectors (Alg. 1 l.4-7) ------------------------------------------------------------------------------
    def build_projectors(self, layers: Iterable[str] | None = None) -> None:
        """P_in and P_out of the given layers (None: every layer with stored covariances), from the running
        covariances. A layer is left unprojected (ΔW = G) when it has no input covariance yet (A15), when its
        partner never ran beside it (P_out = 0, spec §2.3 "seen"), or when a projector has rank 0.
        `ranks[layer]["out"]` is −1 for the one-sided identity P_out."""
        self.projectors, self.ranks, self._device_projectors = {}, {}, {}
        for layer in list(self.covariances) if layers is None else layers:
            built = self._projector_pair(layer)
            if built is not None:
                self.projectors[layer], self.ranks[layer] = built

    def _projector_pair(self, layer: str) -> tuple[tuple[torch.Tensor | None, torch.Tensor], dict[str, int]] | None:
        """((P_out or None, P_in), ranks) of `layer`, or None when it stays unprojected this task."""
        covariances, counts = self.covariances.get(layer), self.counts.get(layer, {})
        if covariances is None or counts.get("in", 0) == 0:
            return None
        (threshold_in, threshold_out), mode = self.thresholds(layer), self.config.threshold_mode
        p_in, rank_in = null_space_projector(covariances["in"], threshold_in, mode)
        p_out, rank_out = None, -1
        if self._dual(layer):
            if counts.get("out", 0) == 0:
                return None
            p_out, rank_out = null_space_projector(covariances["out"], threshold_out, mode)
        if rank_in == 0 or rank_out == 0:
            return None
        return (p_out, p_in), {"in": rank_in, "out": rank_out}

    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        partners = self.layer_partners(model, context.task)
        modules = dict(model.named_modules())
        for layer, partner in partners.items():
            if partner is not None and partner not in modules:
                raise ValueError(f"dns partner {partner!r} of layer {layer!r} is not a module of the model")
        self.build_projectors(partners)
        for layer, ranks in self.ranks.items():
            logger.info("dns task %d: %s rank(P_in)=%d rank(P_out)=%s", context.task_index, layer, ranks["in"],
                        "identity" if ranks["out"] < 0 else ranks["out"])
        if self.config.freeze_others:
            self._flags = requires_grad_flags(model)
            freeze_base(model, [f"{layer}.weight" for layer in partners])

    def after_training(self, context: TaskContext) -> None:
        if self._flags is not None:
            restore_flags(context.model, self._flags)
            self._flags = None

    def _on_device(self, layer: str, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        key = (layer, like.device, like.dtype)
        if key not in self._device_projectors:
            p_out, p_in = self.projectors[layer]
            self._device_projectors[key] = (None if p_out is None else p_out.to(like.device, like.dtype),
                                            p_in.to(like.device, like.dtype))
        return self._device_projectors[key]

    def _project(self, layer: str, matrix: torch.Tensor) -> torch.Tensor:
        """Eq. (8) on `matrix` (a gradient or an update of `layer`'s weight), computed in at least float32."""
        work = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
        p_out, p_in = self._on_device(layer, work)
        return dual_null_space_projection(work, p_out, p_in).to(matrix.dtype)

    # ----- the projection (Alg. 1 l.13) ---------------------------------------------------------------------------
    def pre_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """p.grad ← G − P_out G P_in for every projected layer (after clipping, before `optimizer.step()`); with
        `project="update"` also remember W for `post_optimizer_step`. A bias, if any, is not projected."""
        self._before_step = {}
        with torch.no_grad():
            for layer in self.projectors:
                weight = model.get_parameter(f"{layer}.weight")
                if self.config.project == "update":
                    self._before_step[layer] = weight.detach().clone()
                grad = weight.grad
                if grad is None:
                    continue
                projected = self._project(layer, grad)
                self._removed[layer] = _removed_fraction(grad, projected)
                grad.copy_(projected)

    def post_optimizer_step(self, model: ContinualDualEncoder, context: TaskContext) -> None:
        """`project="update"`: W ← W_old + proj(W − W_old), the step the optimizer made projected by Eq. (8)."""
        with torch.no_grad():
            for layer, before in self._before_step.items():
                weight = model.get_parameter(f"{layer}.weight")
                update = weight.detach() - before
                projected = self._project(layer, update)
                self._update_removed[layer] = _removed_fraction(update, projected)
                weight.copy_(before + projected)
        self._before_step = {}

    def metrics(self) -> dict[str, float | torch.Tensor]:
        """`active` (1 when any layer is projected this task), `rank_in/<layer>`, `rank_out/<layer>` (−1: identity,
        one-sided) and `removed/<layer>`: ‖G − ΔW‖_F / ‖G‖_F of the last step (`update_removed/<layer>` the same
        for the optimizer's update with `project="update"`); the removed fractions are device tensors."""
        values: dict[str, float | torch.Tensor] = {"active": float(bool(self.projectors))}
        for layer, ranks in self.ranks.items():
            values[f"rank_in/{layer}"] = float(ranks["in"])
            values[f"rank_out/{layer}"] = float(ranks["out"])
        values.update({f"removed/{layer}": v for layer, v in self._removed.items()})
        values.update({f"update_removed/{layer}": v for layer, v in self._update_removed.items()})
        return values

    # ----- covariances (Alg. 1 l.16-18) ---------------------------------------------------------------------------
    def on_task_end(self, context: TaskContext) -> None:
        """Fold the task's input and partner-output covariances into the running ones (one no-grad pass): for a
        pair (a, b), C_in[a] += Xa, C_in[b] += Xb, C_out[a] += Yb, C_out[b] += Ya with Y = X Wᵀ (spec §2.5)."""
        model = context.model
        partners = self.layer_partners(model, context.task)
        names = dict.fromkeys([*partners, *(p for p in partners.values() if p is not None)])  # ordered, no repeats
        layers = {name: cast(nn.Linear, model.get_submodule(name)) for name in names}  # `layer_partners`' linears
        grams = self.collect_second_moments(model, layers, context)
        seen_before = self.global_count
        for layer, partner in partners.items():
            gram_in, gram_out, rows = grams[layer]
            if rows == 0:
                continue  # this layer's modality was absent from the task (A15)
            self._fold(layer, "in", gram_in, rows, seen_before)
            if partner is not None and grams[partner][2] > 0:
                _, partner_out, partner_rows = grams[partner]
                self._fold(layer, "out", partner_out, partner_rows, seen_before)
            elif "out" not in self.covariances[layer]:
                self.covariances[layer]["out"] = torch.zeros(gram_out.shape, dtype=torch.float64)
        self.global_count += max((rows for _, _, rows in grams.values()), default=0)
        self.tasks_seen += 1
        self._removed, self._update_removed, self._before_step = {}, {}, {}

    def _fold(self, layer: str, side: str, gram: torch.Tensor, rows: int, seen_before: int) -> None:
        """Merge a pass's Σ x xᵀ over `rows` rows into `layer`'s running mean on `side` (Thm. 8), normalised by the
        layer's own count (paper) or by every row seen before this task (`counts="global"`, A5)."""
        stored = self.covariances.setdefault(layer, {})
        counts = self.counts.setdefault(layer, {"in": 0, "out": 0})
        seen = seen_before if self.config.counts == "global" else counts[side]
        stored[side], counts[side] = merge_second_moment(stored.get(side), seen, gram, rows)

    def collect_second_moments(self, model: ContinualDualEncoder, modules: dict[str, nn.Linear], context: TaskContext
                               ) -> Grams:
        """{layer: (Σ x xᵀ, Σ (Wx)(Wx)ᵀ, rows)} over the task's training data, summed over processes; inputs are
        the rows fed to each module (leading dimensions flattened), outputs bias-free (spec A17) in float64."""
        config = self.config
        batch_size = config.covariance_batch_size or int(context.per_device_batch_size or 32)
        device = next(model.parameters()).device
        sums = {name: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=device),
                       torch.zeros(m.out_features, m.out_features, dtype=torch.float64, device=device),
                       torch.zeros((), dtype=torch.float64, device=device)] for name, m in modules.items()}

        def hook(name: str):  # noqa: ANN202 (a forward hook)
            def record(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
                x = inputs[0].detach()
                gram_in, rows = second_moment(x)
                gram_out, _ = second_moment(nn.functional.linear(x.double(), module.weight.detach().double()))
                sums[name][0] += gram_in
                sums[name][1] += gram_out
                sums[name][2] += rows

            return record

        handles = [module.register_forward_hook(hook(name)) for name, module in modules.items()]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for batch in task_batches(context, self.name, batch_size, config.covariance_max_batches, False):
                    run_batch(model, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        finally:
            for handle in handles:
                handle.remove()
            model.train(was_training)
        result = {}
        for name, (gram_in, gram_out, rows) in sums.items():
            for total in (gram_in, gram_out, rows):
                all_reduce_sum_(total)
            result[name] = (gram_in.cpu(), gram_out.cpu(), int(rows.item()))
        return result

    # ----- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "covariances": {layer: dict(c) for layer, c in self.covariances.items()},
            "counts": {layer: dict(c) for layer, c in self.counts.items()},
            "global_count": self.global_count,
            "tasks_seen": self.tasks_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.covariances = {
            layer: {side: value.double().cpu() for side, value in c.items()}
            for layer, c in state.get("covariances", {}).items()
        }
        self.counts = {
            layer: {side: int(value) for side, value in c.items()} for layer, c in state.get("counts", {}).items()
        }
        self.global_count = int(state.get("global_count", 0))
        self.tasks_seen = int(state.get("tasks_seen", 0))
        self.projectors, self.ranks, self._device_projectors = {}, {}, {}
