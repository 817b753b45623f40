"""TiC-CLIP's non-replay strategies: Sequential, Restart and Oracle (Garg et al., ICLR 2024, §3 I, III, IV and
Tab. 1; specs/ticclip.md §2.2 rules 1, 5, 6 and §2.4).

| strategy   | data at step t      | init at step t        | compute | warmup (with `warmup="first_task"`)   |
|------------|---------------------|-----------------------|---------|---------------------------------------|
| Sequential | D_t                 | last model            | C       | step 1 only                           |
| Restart    | union of D_1..D_t   | fresh random init     | C       | every step (random init, §7 item 13)  |
| Oracle     | union of D_1..D_t   | fresh random init     | t x C   | every step, W_1 steps, cosine over tC |

The replay strategies (Cumulative-All/-Exp/-Equal) are in `tic_replay.py`, Patching in `patching.py`; LwF and EWC are
`lwf` and `ewc` (the LwF teacher's pass over each batch is measured in the run's MACs; EWC's Fisher pass runs
after the task and is not counted as training compute).

Step 1 is the same computation for every strategy (specs/ticclip.md §2.2: "Oracle and Restart at t=1 are the same
computation"), so Restart and Oracle keep the run's initial model at the first task (`reinit_first_task=False`),
and a run shares the first step with the warm-start strategies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from datasets import Dataset

from .base import ContinualMethod, MethodConfig, TaskContext
from .finetune import Finetune
from .registry import register_method
from .tic_replay import CumulativePool, check_stream_sizes

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder


@register_method
class Sequential(Finetune):
    """Sequential (TiC-CLIP §3 III): warm start from the last model, train C iterations on D_t only. The same
    computation as `finetune`, registered under the paper's name so that TiC-CLIP configs read like Tab. 1."""

    name = "sequential"
    same_step_as = "finetune"
    variant_of = "finetune"
    roles = {"training_data": "trains each step on its own data only (TiC-CLIP's Sequential)"}
    conflicts = {"training_data": "trains each step on its own data only (TiC-CLIP's Sequential): leave it out"}


def fresh_model(model: ContinualDualEncoder, seed: int) -> ContinualDualEncoder:
    """A freshly initialised model of `model`'s class and config (vocabulary size included), drawn after
    `torch.manual_seed(seed)` in a forked RNG (the global RNG is left as it was), in `model`'s dtype."""
    config = copy.deepcopy(model.config)
    devices = [torch.device("cuda", torch.cuda.current_device())] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        new = type(model)(config)
    dtype = next(model.parameters()).dtype
    return new.to(dtype=dtype)  # type: ignore[call-arg]  # transformers' @wraps(nn.Module.to) types PreTrainedModel.to unbound


@dataclass
class RestartConfig(MethodConfig):
    reinit_first_task: bool = field(
        default=False,
        metadata={"help": "Also re-initialise at the first task; False keeps the run's initial model there, so that "
                          "step 1 is shared with every other strategy (specs/ticclip.md §2.2)."},
    )
    stream_sizes: list[int] | None = field(
        default=None,
        metadata={"help": "Sizes of streaming (IterableDataset) train splits, one per task, to mix streams in "
                          "proportion to their size; None: equal shares (see tic_replay)."},
    )

    def __post_init__(self) -> None:
        check_stream_sizes(self.stream_sizes)


class FromScratch(ContinualMethod[RestartConfig]):
    """Random init at every step (seeded from the task's seed), trained on the union of all steps so far, with the
    first step's warmup (specs/ticclip.md §2.4 and §7 item 13: Restart and Oracle start from random init)."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    config_class = RestartConfig
    trains_on_past_tasks = True
    roles = {
        "training_data": "trains each step on the union of all steps so far",
        "fresh_model": "starts every step from a freshly initialised model",
    }
    conflicts = {
        "training_data": "already trains each step on the union of all steps so far: use one of them",
        "previous_model": "starts every step from a freshly initialised model: there is no previous model to build on",
    }

    def __init__(self, config: RestartConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.pool = CumulativePool("all", stream_sizes=self.config.stream_sizes)

    def on_task_start(self, context: TaskContext) -> None:
        if context.task_index == 0 and not self.config.reinit_first_task:
            return
        new = fresh_model(context.model, context.seed)
        if context.tokenizer is not None:
            new.align_special_tokens(context.tokenizer)
        context.model = new

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        """D_t and every example of D_1..D_{t-1}, shuffled together (as Cumulative-All, and `joint`)."""
        return self.pool.build(context, dataset)

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        """The first step's warmup (`base_training`'s `warmup_steps`), whatever the run's warmup rule. A float
        below 1 is a ratio in transformers, so it then scales with this task's steps (Oracle's t x C)."""
        base = context.base_training
        return {"warmup_steps": base.get("warmup_steps", 0)}

    def state_dict(self) -> dict[str, Any]:
        return {"pool": self.pool.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state["pool"])


@register_method
class Restart(FromScratch):
    """Restart (TiC-CLIP §3 IV): random init, C iterations on the union of D_1..D_t, warmup + cosine."""

    name = "restart"
    same_step_as = "finetune"
    variant_of = "oracle"


@register_method
class Oracle(FromScratch):
    """Oracle (TiC-CLIP §3 I): random init, t x C iterations on the union of D_1..D_t, with the first step's LR
    recipe (warmup W_1, then cosine over all t x C iterations). Needs a compute budget (`samples_per_task`)."""

    name = "oracle"
    same_step_as = "finetune"
    needs_compute_budget = True

    def training_overrides(self, context: TaskContext, training: dict[str, Any]) -> dict[str, Any]:
        if context.samples_per_task is None or "max_steps" not in training:
            raise ValueError(
                "Oracle trains t x C iterations at step t: the run needs a compute budget C "
                "(ContinualArguments.samples_per_task)"
            )
        overrides = super().training_overrides(context, training)
        overrides["max_steps"] = (context.task_index + 1) * int(training["max_steps"])
        return overrides
