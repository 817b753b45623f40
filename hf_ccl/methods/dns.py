"""DNS, Dual-sided Null Space projection (Liu, Xia, Ng, Chua, "Continual Multimodal Contrastive Learning",
arXiv 2503.14963, NeurIPS 2025), on chosen linear layers of a CLIP. Spec: specs/cmcl.md §2 and §7.

For each chosen `nn.Linear` (weight W [d_out, d_in], y = W x) the gradient G = ∇W is replaced, after clipping and
before the optimizer step, by (Thm. 4, Eq. 8 = Eqs. 36/55; spec §2.3 and A1)

    ΔW = G − P_out G P_in,

- P_in [d_in, d_in], on the RIGHT: the range projector of the uncentered covariance of the layer's OWN inputs on
  all earlier tasks (the paper's P', P);
- P_out [d_out, d_out], on the LEFT: the range projector of the covariance of the PARTNER modality's outputs on
  all earlier tasks (the paper's P̃, P̃'). CLIP's two projections are each other's partner: `visual_projection`'s
  P_out comes from the text embeddings (`text_projection`'s outputs) and `text_projection`'s from the image
  embeddings. The old alignment A = Z_textᵀ Z_image then moves only at second order in the step size
  (spec §2.2: z_textᵀ ΔW x_image = 0 for every old pair).

A chosen layer without a partner (any other linear layer) is projected one-sided, ΔW = G (I − P_in): its own old
outputs then do not move at first order (Adam-NSCL's rule). `variant="one_sided"` does this for every layer: it is
what the official code effectively runs (its output-side threshold 0 keeps the numerically-zero eigenvalues, so
P_out ≈ I; spec A3).

Covariances (Alg. 1 l.16–18, Thm. 8; spec §2.3, A2, A6, A17): at the end of each task, one no-grad, eval-mode pass
over the task's training data (the same batches on every process, dealt round-robin, sums reduced with
`all_reduce_sum_`; see `regularization.task_batches`) collects, through forward hooks, each layer's inputs x and its
bias-free outputs W x with the weights just trained. They are merged into running means
C ← (n̄/(n̄+n)) C + (1/(n̄+n)) Σ x xᵀ with per-layer counts (spec A5). A layer whose module did not run in a task
(its modality was absent) gets no covariance update (A15). The covariances are the method's state; the projectors
are rebuilt from them at every task start (Alg. 1 l.4–7) and fixed for the task.

Thresholds (spec §3, A3, A4): eigenvalues above `threshold_in` / `threshold_out` span the protected subspaces,
absolute by default (the paper's λ_min: 0.01 for ImageBind/UniBind, 1e-4 for LanguageBind), or relative to the
largest eigenvalue (`threshold_mode="relative"`). Threshold 0 on a full-rank covariance gives P = I.

Optimizer (spec §2.4, A7): with AdamW the realised update is G's projection rescaled element-wise by 1/(√v + ε),
plus an unprojected decoupled weight decay, so the guarantee holds only for plain SGD. `project="update"` projects the
gradient AND the update the optimizer actually made: W is remembered before `optimizer.step()` and set to
W_old + proj(W_new − W_old) right after it (`post_optimizer_step`), which is exact at first order whatever the
optimizer and weight decay.

Not covered here: the paper's per-modality learner heads on frozen towers (spec §2.6) and modality-pair streams.
With `freeze_others=True` only the chosen layers' weights train, the closest setting to the paper on a full CLIP.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..distributed import all_reduce_sum_
from .base import ContinualMethod, MethodConfig, TaskContext
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
    from ..modeling import ContinualCLIPModel

logger = logging.getLogger(__name__)

VARIANTS = ("paper", "one_sided")
PROJECT_MODES = ("gradient", "update")
DEFAULT_PARTNERS = {"visual_projection": "text_projection", "text_projection": "visual_projection"}


@dataclass
class DNSConfig(MethodConfig):
    layers: list[str] = field(
        default_factory=lambda: ["visual_projection", "text_projection"],
        metadata={"help": "fnmatch patterns over module names of the nn.Linear layers to project (spec §2.6)."},
    )
    partners: dict[str, str] = field(
        default_factory=lambda: dict(DEFAULT_PARTNERS),
        metadata={
            "help": "Layer -> partner layer whose outputs give the left (output-side) projector (Thm. 4). Layers "
            "without a partner are projected one-sided, G (I - P_in)."
        },
    )
    threshold_in: float = field(
        default=0.01,
        metadata={"help": "λ_min of the input-side (right) projector; paper: 0.01 ImageBind, 1e-4 LanguageBind."},
    )
    threshold_out: float = field(
        default=0.01,
        metadata={"help": "λ_min of the output-side (left) projector (spec A3: the paper's single λ_min)."},
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
    freeze_others: bool = field(
        default=False,
        metadata={"help": "Train only the chosen layers' weights during each task (the paper trains only learners)."},
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
        self.layers = [str(pattern) for pattern in self.layers]
        self.partners = {str(k): str(v) for k, v in dict(self.partners).items()}
        if not self.layers:
            raise ValueError("dns needs at least one layer pattern")
        for name in ("threshold_in", "threshold_out"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        checks = (("threshold_mode", THRESHOLD_MODES), ("variant", VARIANTS), ("project", PROJECT_MODES))
        for name, valid in checks:
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}")
        for name in ("covariance_batch_size", "covariance_max_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


def linear_layers(model: nn.Module, patterns: Iterable[str]) -> dict[str, nn.Linear]:
    """The `nn.Linear` modules whose names match any fnmatch pattern, in `named_modules` order; a pattern that
    matches no linear layer is an error."""
    patterns = list(patterns)
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in linears)]
    if unused:
        raise ValueError(
            f"dns layer pattern(s) {unused} match no nn.Linear of the model (e.g. 'visual_projection', "
            "'text_model.encoder.layers.*.mlp.fc2')"
        )
    return {name: m for name, m in linears.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


@register_method
class DNS(ContinualMethod):
    """Dual-sided null-space gradient projection (Thm. 4, Eq. 8) on chosen linear layers. See the module docstring."""

    name = "dns"
    config_class = DNSConfig
    roles = {"previous_model": "projects each update out of the feature subspaces of the previous tasks"}

    def __init__(self, config: MethodConfig | dict[str, Any] | None = None):
        super().__init__(config)
        #: Running covariances by layer: {"in": C_in [d_in, d_in], "out": C_out [d_out, d_out]} (float64, CPU).
        self.covariances: dict[str, dict[str, torch.Tensor]] = {}
        #: Rows behind each running covariance: {"in": n̄_in, "out": n̄_out}.
        self.counts: dict[str, dict[str, int]] = {}
        self.tasks_seen = 0
        #: This task's projectors by layer: (P_out or None for identity, P_in), float64 on CPU.
        self.projectors: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.ranks: dict[str, dict[str, int]] = {}
        self._device_projectors: dict[tuple[str, torch.device, torch.dtype], tuple] = {}
        self._before_step: dict[str, torch.Tensor] = {}
        self._removed: dict[str, float] = {}
        self._update_removed: dict[str, float] = {}
        self._flags: dict[str, bool] | None = None

    # ----- layers and partners -----------------------------------------------------------------------------------
    def partner(self, layer: str) -> str | None:
        """The layer whose outputs give `layer`'s left projector, or None (one-sided)."""
        if self.config.variant == "one_sided":
            return None
        return self.config.partners.get(layer)

    def targets(self, model: nn.Module) -> dict[str, nn.Linear]:
        return linear_layers(model, self.config.layers)

    # ----- projectors (Alg. 1 l.4-7) ------------------------------------------------------------------------------
    def build_projectors(self) -> None:
        """P_in and P_out of every layer with a stored input covariance, from the running covariances.

        A layer is left unprojected (ΔW = G) when it has no input covariance yet, when its partner never ran beside
        it (P_out = 0, spec §2.3 "seen"), or when a projector has rank 0. `ranks[layer]["out"]` is −1 for the
        one-sided identity P_out."""
        config = self.config
        self.projectors, self.ranks, self._device_projectors = {}, {}, {}
        for layer, covariances in self.covariances.items():
            counts = self.counts.get(layer, {})
            if counts.get("in", 0) == 0:
                continue
            p_in, rank_in = null_space_projector(covariances["in"], config.threshold_in, config.threshold_mode)
            p_out, rank_out = None, -1
            if self.partner(layer) is not None:
                if counts.get("out", 0) == 0:
                    continue
                p_out, rank_out = null_space_projector(
                    covariances["out"], config.threshold_out, config.threshold_mode
                )
            if rank_in == 0 or rank_out == 0:
                continue
            self.projectors[layer] = (p_out, p_in)
            self.ranks[layer] = {"in": rank_in, "out": rank_out}

    def on_task_start(self, context: TaskContext) -> None:
        model = context.model
        targets = self.targets(model)
        for layer in targets:
            partner = self.partner(layer)
            if partner is not None and partner not in dict(model.named_modules()):
                raise ValueError(f"dns partner {partner!r} of layer {layer!r} is not a module of the model")
        self.build_projectors()
        for layer, ranks in self.ranks.items():
            logger.info("dns task %d: %s rank(P_in)=%d rank(P_out)=%s", context.task_index, layer, ranks["in"],
                        "identity" if ranks["out"] < 0 else ranks["out"])
        if self.config.freeze_others:
            self._flags = requires_grad_flags(model)
            freeze_base(model, [f"{layer}.weight" for layer in targets])
        return None

    def after_training(self, context: TaskContext) -> None:
        if self._flags is not None:
            restore_flags(context.model, self._flags)
            self._flags = None
        return None

    def _on_device(self, layer: str, like: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        key = (layer, like.device, like.dtype)
        if key not in self._device_projectors:
            p_out, p_in = self.projectors[layer]
            move = {"device": like.device, "dtype": like.dtype}
            self._device_projectors[key] = (None if p_out is None else p_out.to(**move), p_in.to(**move))
        return self._device_projectors[key]

    def _project(self, layer: str, matrix: torch.Tensor) -> torch.Tensor:
        """Eq. (8) on `matrix` (a gradient or an update of `layer`'s weight), computed in at least float32."""
        work = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
        p_out, p_in = self._on_device(layer, work)
        return dual_null_space_projection(work, p_out, p_in).to(matrix.dtype)

    # ----- the projection (Alg. 1 l.13) ---------------------------------------------------------------------------
    def pre_optimizer_step(self, model: ContinualCLIPModel, context: TaskContext) -> None:
        """p.grad ← G − P_out G P_in for every projected layer (after clipping, before `optimizer.step()`); with
        `project="update"` also remember W for `post_optimizer_step`."""
        self._before_step = {}
        if not self.projectors:
            return
        targets = self.targets(model)
        with torch.no_grad():
            for layer in self.projectors:
                weight = targets[layer].weight
                if self.config.project == "update":
                    self._before_step[layer] = weight.detach().clone()
                grad = weight.grad
                if grad is None:
                    continue
                projected = self._project(layer, grad)
                norm = grad.float().norm()
                self._removed[layer] = float((grad.float() - projected.float()).norm() / norm) if norm > 0 else 0.0
                grad.copy_(projected)

    def post_optimizer_step(self, model: ContinualCLIPModel, context: TaskContext) -> None:
        """`project="update"`: W ← W_old + proj(W − W_old), the step the optimizer made projected by Eq. (8)."""
        if not self._before_step:
            return
        targets = self.targets(model)
        with torch.no_grad():
            for layer, before in self._before_step.items():
                weight = targets[layer].weight
                update = weight.detach() - before
                projected = self._project(layer, update)
                norm = update.float().norm()
                removed = (update.float() - projected.float()).norm() / norm if norm > 0 else norm.new_zeros(())
                self._update_removed[layer] = float(removed)
                weight.copy_(before + projected)
        self._before_step = {}

    def metrics(self) -> dict[str, float]:
        """`active` (1 when any layer is projected this task), `rank_in/<layer>`, `rank_out/<layer>` (−1: identity,
        one-sided) and `removed/<layer>`: ‖G − ΔW‖_F / ‖G‖_F of the last step (`update_removed/<layer>` the same
        for the optimizer's update with `project="update"`)."""
        values: dict[str, float] = {"active": float(bool(self.projectors))}
        for layer, ranks in self.ranks.items():
            values[f"rank_in/{layer}"] = float(ranks["in"])
            values[f"rank_out/{layer}"] = float(ranks["out"])
        values.update({f"removed/{layer}": v for layer, v in self._removed.items()})
        values.update({f"update_removed/{layer}": v for layer, v in self._update_removed.items()})
        return values

    # ----- covariances (Alg. 1 l.16-18) ---------------------------------------------------------------------------
    def on_task_end(self, context: TaskContext) -> None:
        """Fold the task's input and partner-output covariances into the running ones (one no-grad pass)."""
        model = context.model
        targets = self.targets(model)
        modules = dict(model.named_modules())
        watched = dict(targets)
        for layer in targets:
            partner = self.partner(layer)
            if partner is not None:
                watched[partner] = modules[partner]
        grams = self.collect_second_moments(model, watched, context)
        for layer in targets:
            gram_in, gram_out, rows = grams[layer]
            if rows == 0:
                continue  # this layer's modality was absent from the task (A15)
            stored = self.covariances.setdefault(layer, {})
            counts = self.counts.setdefault(layer, {"in": 0, "out": 0})
            stored["in"], counts["in"] = merge_second_moment(stored.get("in"), counts["in"], gram_in, rows)
            partner = self.partner(layer)
            if partner is not None and grams[partner][2] > 0:
                _, partner_out, partner_rows = grams[partner]
                stored["out"], counts["out"] = merge_second_moment(
                    stored.get("out"), counts["out"], partner_out, partner_rows
                )
            elif "out" not in stored:
                stored["out"] = torch.zeros(gram_out.shape, dtype=torch.float64)
        self.tasks_seen += 1
        self._removed, self._update_removed = {}, {}

    def collect_second_moments(
        self, model: nn.Module, modules: dict[str, nn.Linear], context: TaskContext
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """{layer: (Σ x xᵀ, Σ (Wx)(Wx)ᵀ, rows)} over the task's training data, summed over processes; inputs are
        the rows fed to each module (leading dimensions flattened), outputs bias-free (spec A17)."""
        config = self.config
        batch_size = config.covariance_batch_size or int(context.per_device_batch_size or 32)
        device = next(model.parameters()).device
        sums = {
            name: [
                torch.zeros(m.in_features, m.in_features, dtype=torch.float64, device=device),
                torch.zeros(m.out_features, m.out_features, dtype=torch.float64, device=device),
                torch.zeros((), dtype=torch.float64, device=device),
            ]
            for name, m in modules.items()
        }

        def hook(name: str):
            def record(module: nn.Linear, inputs: tuple, output: torch.Tensor) -> None:
                x = inputs[0].detach()
                gram_in, rows = second_moment(x)
                gram_out, _ = second_moment(nn.functional.linear(x, module.weight))
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
                    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    if "pixel_values" in batch:
                        model.embed_images(batch["pixel_values"], normalize=False)
                    if "input_ids" in batch:
                        model.embed_texts(batch["input_ids"], batch.get("attention_mask"), normalize=False)
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
        self.tasks_seen = int(state.get("tasks_seen", 0))
        self.projectors, self.ranks, self._device_projectors = {}, {}, {}
