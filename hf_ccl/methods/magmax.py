"""MagMax (Marczak et al. 2024, "MagMax: Leveraging Model Merging for Seamless Continual Learning", ECCV;
arXiv 2407.06322; code github.com/danielm1405/magmax @ 4f49f18).

Sequential fine-tuning, then, after every task t, the deployed model (evaluated and saved) is

    τ_i = θ_i − θ_0                                  the task vector of task i (θ_i: the weights fine-tuned on task i)
    τ_MagMax[p] = τ_k[p],  k = argmax_{i ≤ t} |τ_i[p]|   per parameter entry p, over the tasks seen so far
    θ_MagMax = θ_0 + λ · τ_MagMax

(the paper's merge rule, θ_MagMax = θ_0 + λ τ_MagMax with τ_MagMax^p = τ_k^p, k = argmax_i |τ_i^p|, as its abstract
and summaries state it: the paper's own text, and so its equation numbers, could not be read here; the rule is checked
against the code: `merge_max_abs` in src/merging/task_vectors.py, applied by `TaskVector.apply_to(θ_0,
scaling_coef=λ)`). θ_0 is the model before the first task. The next task trains from the
sequentially fine-tuned θ_t, not from the merge (finetune_splitted.py with `--sequential-finetuning` loads
`finetuned_{t-1}.pt`, the fine-tuned encoder saved before any merge; merging is a separate script that only reads
those checkpoints).

The merge is kept as one running model-sized tensor set: argmax over i ≤ t of |τ_i[p]| is associative, so
τ_MagMax after task t = select(τ_MagMax after t−1, τ_t). `merge_task_vectors` computes the same over stored task
vectors (tests check the two agree).

Options:
- `scale`: λ. 0.5, the coefficient the official merge scripts use for `merge_max_abs` (merge_splitted.py,
  merge_domain_splitted.py, merge_8datasets.py); the paper keeps one fixed λ across settings (its value in the
  paper's text could not be read here).
- `merge`: "max_magnitude" (MagMax), or the paper's baselines over the same task vectors: "average" (the mean of
  the task vectors; the code's `sum` with coefficient 1/n, i.e. `scale: 1.0` here) and "random" (random mixing:
  each entry taken from one of the seen task vectors uniformly at random; the code's `merge_rnd_mix`, coefficient
  1.0). Random mixing is kept running by reservoir sampling (after task n each entry is replaced by τ_n's with
  probability 1/n): the same distribution as the code's draw, not its bits; seeded by `seed` and n.
- `training`: "sequential" (MagMax: each task continues from the previous task's fine-tuned weights) or
  "independent" (the paper's "Ind FT" rows: every task trains from θ_0).
- `ties`: which task vector an entry takes when several have the largest magnitude. "later" (default): the latest
  task, as the code (`torch.where(|τ_new| >= |τ_max|, τ_new, τ_max)`); "earlier": the first (torch.argmax's
  convention). The paper does not say.

What is merged: every floating-point tensor of the state dict (both towers, biases, embeddings, layer norms and
`logit_scale`); integer buffers are the fine-tuned model's. The official code merges the whole open_clip state dict
of its image classifier, whose text tower and logit scale are never trained (zero task vectors), so only the image
tower moves there; here a frozen tensor has τ = 0 and keeps θ_0 exactly, and what a run trains is what is merged.

Composition: methods that build on the task-start model (LwF's and Mod-X's teachers, CTP's momentum model, ZSCL) must
come after `magmax` in the method list (refused otherwise), so that they see θ_{t−1}, as the paper's "LwF + MagMax"
(the official lwf.py trains sequentially from the fine-tuned checkpoints). Methods that read the model at a task's
end (EWC's and MAS's anchors and importances, DNS's covariances) read the deployed merge, not θ_t (the official
ewc.py anchors θ_t): their combination with `magmax` is not the paper's "EWC + MagMax".

State (saved beside each checkpoint, for an exact resume): θ_0, the running merged task vector, the number of tasks
merged, and between tasks (sequential only) the fine-tuned weights the next task starts from: up to three
model-sized tensor sets on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .weight_ensemble import check_same_shapes, cpu_state_dict

logger = logging.getLogger(__name__)

MERGES = ("max_magnitude", "average", "random")


@dataclass
class MagMaxConfig(MethodConfig):
    scale: float = field(
        default=0.5,
        metadata={"help": "λ in θ = θ_0 + λ τ_merged (>= 0); 0.5 as the official MagMax merge scripts."},
    )
    merge: Literal["max_magnitude", "average", "random"] = field(
        default="max_magnitude",
        metadata={"help": "'max_magnitude' (MagMax: per entry the task vector of largest |τ|), 'average' (the mean "
                          "task vector) or 'random' (random mixing): the paper's merges."},
    )
    training: Literal["sequential", "independent"] = field(
        default="sequential",
        metadata={"help": "'sequential' (MagMax: each task trains from the previous task's fine-tuned weights) or "
                          "'independent' (each task trains from the model before the first task: 'Ind FT')."},
    )
    ties: Literal["later", "earlier"] = field(
        default="later",
        metadata={"help": "Equal magnitudes: take the 'later' task's entry (the official code's >=) or the "
                          "'earlier' one's (torch.argmax)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of random mixing (merge: random)."})

    def __post_init__(self) -> None:
        check_range("scale", self.scale, 0.0)
        check_range("seed", self.seed, 0)


# ----------------------------------------------------------------------------------------------------------------
# The merge
# ----------------------------------------------------------------------------------------------------------------
def task_vector(initial: Mapping[str, torch.Tensor], finetuned: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """τ = θ_finetuned − θ_0 over the floating-point tensors, on the CPU, in float32 (or wider)."""
    vector = {}
    for name, tensor in finetuned.items():
        if torch.is_floating_point(tensor):
            work = torch.promote_types(tensor.dtype, torch.float32)
            vector[name] = tensor.detach().to("cpu", work) - initial[name].to("cpu", work)
    return vector


def select_max_magnitude(merged: torch.Tensor, new: torch.Tensor, ties: str = "later") -> torch.Tensor:
    """Per entry, `new`'s value where its magnitude is the larger (also where equal, with ties="later")."""
    take = new.abs() >= merged.abs() if ties == "later" else new.abs() > merged.abs()
    return torch.where(take, new, merged)


def merge_task_vectors(vectors: Sequence[Mapping[str, torch.Tensor]], merge: str = "max_magnitude",
                       ties: str = "later") -> dict[str, torch.Tensor]:
    """The merge of stored task vectors at once (the reference `MagMax`'s running merge is checked against):
    "max_magnitude": τ_k[p] with k = argmax_i |τ_i[p]| (the last maximum with ties="later", the first with
    "earlier"); "average": the mean."""
    if not vectors:
        raise ValueError("merge_task_vectors: no task vectors")
    merged = {}
    for name in vectors[0]:
        stack = torch.stack([vector[name] for vector in vectors])
        if merge == "average":
            merged[name] = stack.mean(0)
        elif merge == "max_magnitude":
            order = stack.flip(0) if ties == "later" else stack
            index = order.abs().argmax(0, keepdim=True)
            merged[name] = order.gather(0, index)[0]
        else:
            raise ValueError(f"merge_task_vectors: merge must be 'max_magnitude' or 'average', got {merge!r}")
    return merged


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@register_method
class MagMax(ContinualMethod[MagMaxConfig]):
    """MagMax after every task: deploy θ_0 + λ · (the max-magnitude merge of the task vectors so far)."""

    fsdp_refusal = None  # the merge runs on the gathered model between tasks, as wise_ft's (tests/test_fsdp.py)
    name = "magmax"
    same_step_as = "finetune"
    config_class = MagMaxConfig
    roles = {
        "previous_model": "continues each task from the previous task's fine-tuned weights (training: sequential)",
        "weight_interpolation": "deploys θ_0 plus a merge of the task vectors instead of the trained model",
    }
    conflicts = {
        "parameter_efficient": "merges whole state dicts with the model before the first task, whose modules a "
                               "parameter-efficient method changes during each task (adapters injected and merged)",
        "weight_interpolation": "replaces the deployed model after training and restores the fine-tuned one at the "
                                "next task's start: another method doing the same would undo it; use one",
        "weight_average": "takes each task's trained weights as θ_t; a mean of the weights along the task in their "
                          "place is not the paper's method",
    }
    runs_after = {"vocabulary": "snapshots the model before the first task, which must have the grown vocabulary"}
    runs_before = {"previous_model": "restores the previous task's fine-tuned weights at each task's start, which a "
                                     "method that builds on the previous model (a teacher, a momentum model) must "
                                     "see instead of the deployed merge"}

    def __init__(self, config: MagMaxConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.initial: dict[str, torch.Tensor] | None = None  # θ_0, on the CPU
        self.merged: dict[str, torch.Tensor] | None = None  # the running merged task vector
        self.count = 0  # task vectors merged
        self.finetuned: dict[str, torch.Tensor] | None = None  # θ_t to continue from (sequential, between tasks)
        self.restart = False  # the next task starts from θ_0 (independent, between tasks)

    def on_task_start(self, context: TaskContext) -> None:
        """Take θ_0 (first task), then start the task from the last fine-tuned weights or from θ_0."""
        model = context.model
        if self.initial is None:
            self.initial = cpu_state_dict(model)
        check_same_shapes(self.initial, model, "magmax (the model before the first task)")
        if self.finetuned is not None:
            model.load_state_dict(self.finetuned)
        elif self.restart:
            model.load_state_dict(self.initial)
        self.finetuned, self.restart = None, False

    def after_training(self, context: TaskContext) -> None:
        """Merge τ_t into the running merge, keep θ_t to continue from, deploy θ_0 + λ τ_merged (in place)."""
        if self.initial is None:
            raise ValueError("magmax: no initial model (on_task_start did not run for this task)")
        model = context.model
        finetuned = model.state_dict()
        self._add(task_vector(self.initial, finetuned))
        if self.config.training == "sequential":
            self.finetuned = cpu_state_dict(model)
        else:
            self.restart = True
        model.load_state_dict(self.deployed(finetuned))
        logger.info("MagMax, task %d (%s): deployed θ_0 + %.3g * %s merge of %d task vector(s)", context.task_index,
                    context.task.name, self.config.scale, self.config.merge, self.count)

    def deployed(self, finetuned: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """θ_0 + λ τ_merged for the floating-point tensors (in each tensor's dtype, on its device); the others are
        `finetuned`'s."""
        if self.initial is None or self.merged is None:
            raise ValueError("magmax: nothing merged yet")
        out = {}
        for name, target in finetuned.items():
            if name not in self.merged:
                out[name] = target.clone()
                continue
            vector = self.merged[name]
            value = self.initial[name].to(vector.dtype) + self.config.scale * vector
            out[name] = value.to(device=target.device, dtype=target.dtype)
        return out

    def _add(self, vector: dict[str, torch.Tensor]) -> None:
        self.count += 1
        if self.merged is None:
            self.merged = vector
            return
        if set(vector) != set(self.merged):
            raise ValueError(f"magmax: the model's tensors changed since the first task "
                             f"({sorted(set(vector) ^ set(self.merged))[:5]})")
        merge = self.config.merge
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.count)
        for name in sorted(vector):
            old, new = self.merged[name], vector[name]
            if merge == "max_magnitude":
                self.merged[name] = select_max_magnitude(old, new, self.config.ties)
            elif merge == "average":
                self.merged[name] = old.lerp(new, 1.0 / self.count)
            else:  # random mixing, by reservoir sampling: every seen task equally likely per entry
                take = torch.rand(new.shape, generator=generator) < 1.0 / self.count
                self.merged[name] = torch.where(take, new, old)

    def state_dict(self) -> dict[str, Any]:
        """θ_0, the running merge and its count; between tasks the weights the next task starts from."""
        return {"initial": self.initial, "merged": self.merged, "count": self.count, "finetuned": self.finetuned,
                "restart": self.restart}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = _cpu(state.get("initial"))
        self.merged = _cpu(state.get("merged"))
        self.count = int(state.get("count", 0))
        self.finetuned = _cpu(state.get("finetuned"))
        self.restart = bool(state.get("restart", False))


def _cpu(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {name: t.detach().to("cpu") for name, t in tensors.items()}
