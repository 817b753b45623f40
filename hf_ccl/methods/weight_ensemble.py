"""Weight-space ensembles: ZSCL's weight ensemble during training, and the weight-space helpers the interpolation
methods share (`interpolate_state_dicts`: `wise_ft`, `patching`).

**The weight ensemble** (Zheng et al. 2023, "Preventing Zero-Shot Transfer Degradation in Continual Learning of
Vision-Language Models", ICCV; §3.3 "weight ensemble"): every I optimizer steps the weights are averaged into a
running mean that starts at the model the task starts from,

    θ̂_0 = θ_0,        θ̂_k = 1/(k+1) · θ_k + k/(k+1) · θ̂_{k-1}        (θ_k: the weights at the k-th averaging)

i.e. θ̄ ← (θ̄·n + θ)/(n+1), n the number of models already in the mean (θ_0 included). At the task's end the deployed
model (evaluated, saved and continued from) is θ̂: the uniform mean of θ_0 and every snapshot.

What the official code does (github.com/Thunderbeee/ZSCL @ b96e714, `mtil/src/models/`):
- finetune.py L24-33: `we_model = copy.deepcopy(model)`, `we_n = 0`, right after `--load` of the previous task's
  model: the mean starts afresh at every task (each task is a new process) and includes the task-start weights θ_0.
- finetune.py L305-322: after `optimizer.step()`, `if args.we and iteration % args.avg_freq == 0: we_n += 1;
  merge_we(model.module, we_model, we_n)`; helpers.py L31-34 `merge_we`: `param_k = (param_k * sma_count + param_q)
  / (1.0 + sma_count)` over `parameters()`.
- finetune.py L344-351: the saved model is `we_model`, which the next task `--load`s: it continues from θ̂.
- scripts/ZSCL.sh: `--we --avg_freq 100 --iterations 1000` (I = 100, `every`'s default; src/args.py L56-60).
  (scripts/we.sh and WE_WiSE.sh pass `--swa` / `--swa_wise`, which src/args.py no longer defines.)

Paper and code agree on the formula, on a fresh mean per task that includes θ_0, and on continuing from θ̂. They
differ on *which* steps are averaged: the code's test is on the 0-based `iteration`, after that iteration's optimizer
step, so it averages the weights after optimizer steps 1, 1+I, 1+2I, ...; and its loop is `range(total_iterations
+ 1)` (L180), so `--iterations 1000` trains 1001 steps and the last snapshot is the final weights (step 1001). The
paper's "every I iterations" is steps I, 2I, ... (`schedule="paper"`, the default); `schedule="code"` averages after
steps 1, 1+I, 1+2I, ... (with `max_steps=1001` for ZSCL's 1000-iteration runs exactly).

Also: the average covers every floating-point tensor of the state dict (parameters and float buffers; integer
buffers stay the model's own), where ZSCL's covers `parameters()`: the same tensors for CLIP. The update is computed
as θ̄ + (θ − θ̄)/(n+1) (`torch.lerp`), equal to (θ̄·n + θ)/(n+1) in exact arithmetic and exact for a tensor that
did not move (a frozen parameter keeps its bits). The mean is kept in float32 (in the tensor's own dtype when wider).

**When a snapshot is taken.** "The weights after optimizer step s" are those step s+1 starts from: after every
post-step edit, the trainer's logit-scale clamp included, which runs after the methods' `post_optimizer_step`. So
`update` (at `post_optimizer_step`) marks step s as due, and the weights are averaged in at `flush`: the next
`pre_optimizer_step`, or `apply` at the task's end. A mid-task checkpoint saves the due mark, and a run resumed from
it holds exactly that step's weights when its first `pre_optimizer_step` flushes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..validation import check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method

logger = logging.getLogger(__name__)

SCHEDULES = ("paper", "code")


# ----------------------------------------------------------------------------------------------------------------
# Weight-space helpers shared by the interpolation methods
# ----------------------------------------------------------------------------------------------------------------
def interpolate_state_dicts(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """(1 - alpha) * old + alpha * new for every floating-point tensor (computed in float32 when the tensor is in a
    lower precision, then cast back), on `new`'s device; other tensors (integer buffers) are copied from `new`.
    alpha = 0 gives `old` and alpha = 1 gives `new`, bit for bit."""
    if set(old) != set(new):
        raise ValueError(f"State dicts differ in keys: {sorted(set(old) ^ set(new))[:5]}")
    alpha = float(alpha)
    out: dict[str, torch.Tensor] = {}
    for name, target in new.items():
        if not torch.is_floating_point(target):
            out[name] = target.clone()
            continue
        source = old[name].to(device=target.device)
        if source.shape != target.shape:
            raise ValueError(f"{name}: shape {tuple(source.shape)} vs {tuple(target.shape)}")
        work = torch.promote_types(target.dtype, torch.float32)
        mixed = (1.0 - alpha) * source.to(work) + alpha * target.to(work)
        out[name] = mixed.to(target.dtype)
    return out


def cpu_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of `model`'s state dict (every tensor its own storage, as safetensors wants)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def check_same_shapes(reference: Mapping[str, torch.Tensor], model: nn.Module, what: str) -> None:
    """ValueError unless `model`'s state dict has the keys and shapes of `reference` (checked before a task trains,
    so that an interpolation that cannot be made fails before the training, not after it)."""
    state = model.state_dict()
    if set(state) != set(reference):
        different = sorted(set(state) ^ set(reference))
        raise ValueError(f"{what}: the model's tensors differ from the reference's ({different[:5]}); the model's "
                         "modules changed since the reference was taken")
    for name, tensor in state.items():
        if tensor.shape != reference[name].shape:
            raise ValueError(f"{what}: the model's {name} has shape {tuple(tensor.shape)}, the reference's "
                             f"{tuple(reference[name].shape)} (a vocabulary grown since the reference was taken?)")


# ----------------------------------------------------------------------------------------------------------------
# The running mean, reusable by any method (`zscl`)
# ----------------------------------------------------------------------------------------------------------------
class WeightEnsemble:
    """A running uniform mean of a model's weights along one task's training (ZSCL §3.3, see the module docstring).

    Wiring through a method's hooks (what `weight_ensemble` does; a method that composes it does the same):

        on_task_start:        ensemble.reset()                      # the mean starts at the first flush: θ_0
        pre_optimizer_step:   ensemble.flush(model)                 # θ_0 at the first step, then any due snapshot
        post_optimizer_step:  ensemble.update(model, context.global_step + 1)
        after_training:       ensemble.apply(context.model)         # deploy θ̂ (in place)
        state_dict / load_state_dict: ensemble.state_dict() / ensemble.load_state_dict(state)

    `reset(model)` takes θ_0 at once instead (the first flush then only averages). Taking θ_0 at the first flush
    means the mean has the modules the model trains with, after every task-start hook (adapters, a grown vocabulary).

    `every`: averaging interval I; `schedule`: "paper" averages after optimizer steps I, 2I, ..., "code" after steps
    1, 1+I, 1+2I, ... (ZSCL's code); `offload`: keep the mean in CPU memory (default: beside the weights, as ZSCL).
    """

    def __init__(self, every: int = 100, schedule: str = "paper", offload: bool = False):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        self.every, self.schedule, self.offload = int(every), schedule, bool(offload)
        self.reset()

    # ----- the schedule ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the weights after optimizer step `step` (1-based, of this task) go into the mean."""
        if step < 1:
            return False
        return (step if self.schedule == "paper" else step - 1) % self.every == 0

    # ----- the hooks -----------------------------------------------------------------------------------------
    def reset(self, model: nn.Module | None = None) -> None:
        """Start a new mean: at `model`'s weights now (θ_0), or, without a model, at the next `flush`."""
        self.average: dict[str, torch.Tensor] | None = None
        self.count = 0  # models in the mean, θ_0 included
        self.steps: list[int] = []  # optimizer steps whose weights are in the mean
        self.pending: int | None = None  # a due step whose weights are not averaged in yet
        self.scalars: list[str] = []  # 0-d tensors FSDP2 trained as [1] (`_gather`)
        if model is not None:
            self._start(model)

    @torch.no_grad()
    def flush(self, model: nn.Module) -> None:
        """Before an optimizer step (and at the task's end): take θ_0 if the mean has not started, then average in
        the weights of a due step. `model` then holds the weights after that step."""
        if self.average is None:
            self._start(model)
        if self.pending is None:
            return
        names, targets = self._targets(model)
        averages = self._averages(names)
        current = [t.to(device=a.device, dtype=a.dtype) for t, a in zip(targets, averages, strict=True)]
        self.count += 1
        if any(isinstance(a, DTensor) for a in averages):  # FSDP2: each process averages its own shards
            for average, value in zip(averages, current, strict=True):
                average.lerp_(value, 1.0 / self.count)
        else:
            torch._foreach_lerp_(averages, current, 1.0 / self.count)
        self.steps.append(self.pending)
        self.pending = None

    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step `step` (1-based, of this task; from `post_optimizer_step`): mark it for the mean if it
        is due. Its weights are averaged in at the next `flush`, after the trainer's own post-step edits."""
        if self.average is None:
            raise RuntimeError("WeightEnsemble.update before the mean started: call flush(model) before each "
                               "optimizer step (or reset(model) at the task's start)")
        if self.pending is not None:
            raise RuntimeError(f"WeightEnsemble: step {self.pending} is due but was never averaged in: call "
                               "flush(model) before each optimizer step")
        if self.due(step) and (not self.steps or step > self.steps[-1]):
            self.pending = int(step)

    def check_steps(self, steps: int, where: str, option: str) -> None:
        """Refuse a task of `steps` optimizer steps in which no snapshot would be due (its mean would be the task's
        starting weights): `where` names the task, `option` the interval's config key."""
        if not any(self.due(step) for step in range(1, min(steps, self.every + 1) + 1)):
            raise ValueError(
                f"{where} trains {steps} optimizer step(s), fewer than the weight ensemble's averaging interval "
                f"({option}={self.every}, schedule {self.schedule!r}): its mean would be the task's starting weights "
                f"and the task's training would be discarded. Lower {option} or train the task longer")

    @torch.no_grad()
    def apply(self, model: nn.Module) -> None:
        """Load the mean into `model`, in place (averaging in the final weights first if their step is due).

        A mean that holds no snapshot (the task trained fewer steps than `every`) is refused: it is the task's
        starting weights, and deploying it would throw the whole task's training away without a word."""
        self._gather()
        self.flush(model)
        if not self.steps:
            raise ValueError(
                f"The weight ensemble averaged no weights of this task: it trained fewer optimizer steps than the "
                f"averaging interval ({self.every}), so its mean is the task's starting weights and the task's "
                "training would be discarded. Lower the interval (weight_ensemble: every; zscl: ensemble_every; "
                "ZSCL averages every 100 of 1000 iterations) or train the task longer."
            )
        names, targets = self._targets(model)
        for target, average in zip(targets, self._averages(names), strict=True):
            target.copy_(average)
        logger.info("Weight ensemble: deployed the mean of %d models (task start and steps %s)", self.count,
                    self.steps)

    # ----- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The mean (None before it started), its size and steps, and a due step not averaged in yet."""
        return {"average": None if self.average is None else dict(self.average), "count": self.count,
                "steps": list(self.steps), "pending": self.pending}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; the mean moves to the model's device at its next use (unless offloaded)."""
        average = state.get("average")
        self.average = None if average is None else {
            name: tensor.detach().to("cpu", copy=True) for name, tensor in average.items()}
        self.count = int(state.get("count", 0))
        self.steps = [int(s) for s in state.get("steps", [])]
        pending = state.get("pending")
        self.pending = None if pending is None else int(pending)

    # ----- internals -----------------------------------------------------------------------------------------
    def _start(self, model: nn.Module) -> None:
        names, targets = self._targets(model, check=False)
        self.average = {
            name: t.detach().to(device="cpu" if self.offload else t.device,
                                dtype=torch.promote_types(t.dtype, torch.float32), copy=True)
            for name, t in zip(names, targets, strict=True)
        }
        self.count, self.steps, self.pending = 1, [], None

    def _gather(self) -> None:
        """A mean of a student sharded by FSDP2 (`hf_ccl.sharding`), kept as shards like its weights while the task
        trains, made whole (a collective call, from `apply` on every process): the plain model the loop gathers
        after training takes it, and the method state has the format it has without FSDP. The scalars FSDP2 trains
        with shape [1] take their 0-d shape back, as the gathered model's do."""
        if self.average is None or not any(isinstance(a, DTensor) for a in self.average.values()):
            return
        self.average = {name: value.full_tensor() if isinstance(value, DTensor) else value
                        for name, value in self.average.items()}
        self.scalars = [name for name, value in self.average.items() if value.shape == (1,)]

    def _targets(self, model: nn.Module, check: bool = True) -> tuple[list[str], list[torch.Tensor]]:
        """The floating-point tensors of `model`'s state dict (sharing the weights' storage), by name; the mean moved
        beside them if it is not offloaded and was restored on another device."""
        state = model.state_dict()
        names = [name for name, tensor in state.items() if torch.is_floating_point(tensor)]
        targets = [state[name] for name in names]
        if check and self.average is not None:
            if set(names) != set(self.average):
                different = sorted(set(names) ^ set(self.average))
                raise ValueError(f"WeightEnsemble: the model's tensors differ from the mean's ({different[:5]}): its "
                                 "modules changed since the mean started")
            for name, target in zip(names, targets, strict=True):
                average = self.average[name]
                if target.dim() == 0 and average.shape == (1,) and name in self.scalars:
                    average = self.average[name] = average.reshape(())  # trained as [1] under FSDP2
                if average.shape != target.shape:
                    raise ValueError(f"WeightEnsemble: {name} has shape {tuple(target.shape)}, the mean's "
                                     f"{tuple(average.shape)}")
                if not self.offload and average.device != target.device:
                    self.average[name] = average.to(target.device)
        return names, targets

    def _averages(self, names: list[str]) -> list[torch.Tensor]:
        if self.average is None:
            raise RuntimeError("WeightEnsemble: no mean yet (reset() before the first step)")
        return [self.average[name] for name in names]


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class WeightEnsembleConfig(MethodConfig):
    every: int = field(
        default=100,
        metadata={"help": "Average the weights in every `every` optimizer steps (ZSCL's I: `--avg_freq 100`)."},
    )
    schedule: Literal["paper", "code"] = field(
        default="paper",
        metadata={"help": "'paper': after optimizer steps every, 2*every, ... (ZSCL §3.3, 'every I iterations'); "
                          "'code': after steps 1, 1+every, 1+2*every, ... (ZSCL's finetune.py tests the 0-based "
                          "iteration after its step)."},
    )
    offload: bool = field(
        default=False,
        metadata={"help": "Keep the running mean in CPU memory (default: on the weights' device, as ZSCL)."},
    )

    def __post_init__(self) -> None:
        check_range("every", self.every, 1)


@register_method
class WeightEnsembleMethod(ContinualMethod[WeightEnsembleConfig]):
    """ZSCL's weight ensemble: deploy the running mean of the weights along each task's training (module docstring)."""

    fsdp_refusal = None  # trains sharded as unsharded; the mean is kept as shards (tests/test_fsdp.py)
    name = "weight_ensemble"
    test_options = {"every": 1}  # an ensemble step within a few-step task
    same_step_as = "zscl"
    config_class = WeightEnsembleConfig
    roles = {
        "previous_model": "averages the weights along each task's training with the model the task starts from",
        "weight_average": "deploys the mean of the weights along each task's training instead of the trained model",
    }
    conflicts = {"weight_average": "already deploys a mean of the weights along each task's training: use one"}
    runs_before = {
        "weight_interpolation": "replaces the trained model by its weight mean after training, which an "
                                "interpolation of the trained model must then start from (methods "
                                "[weight_ensemble, wise_ft])",
        "parameter_efficient": "deploys its mean into the adapted model before the adapter is merged after training "
                               "(methods [weight_ensemble, lora])",
    }

    def __init__(self, config: WeightEnsembleConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.ensemble = WeightEnsemble(self.config.every, self.config.schedule, self.config.offload)
        self.history: dict[int, list[int]] = {}  # task index -> the optimizer steps averaged (θ_0 besides)

    def check_task_steps(self, task_index: int, task_name: str, steps: int) -> None:
        self.ensemble.check_steps(steps, f"Task {task_index} ({task_name!r})", "method_args.weight_ensemble.every")

    def on_task_start(self, context: TaskContext) -> None:
        self.ensemble.reset()

    def pre_optimizer_step(self, model: nn.Module, context: TaskContext) -> None:
        self.ensemble.flush(model)

    def post_optimizer_step(self, model: nn.Module, context: TaskContext) -> None:
        self.ensemble.update(model, context.global_step + 1)

    def after_training(self, context: TaskContext) -> None:
        """Deploy θ̂ (in place), then drop the mean: the next task starts a new one from θ̂."""
        self.ensemble.apply(context.model)
        self.history[context.task_index] = list(self.ensemble.steps)
        self.ensemble.reset()

    def state_dict(self) -> dict[str, Any]:
        """The steps averaged at each task; mid-task, the running mean (see `WeightEnsemble.state_dict`)."""
        return {"history": {str(k): v for k, v in sorted(self.history.items())},
                "ensemble": self.ensemble.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {int(k): [int(s) for s in v] for k, v in state.get("history", {}).items()}
        self.ensemble.load_state_dict(state.get("ensemble", {}))
