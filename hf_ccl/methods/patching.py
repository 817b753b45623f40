"""Sequential patching (Ilharco et al. 2022, "Patching open-vocabulary models by interpolating weights", NeurIPS;
TiC-CLIP §3 V, Tab. 1; specs/ticclip.md §2.2 rule 7, §2.5 and §7 item 16).

At step t the model trains from the last *patched* model theta^p_{t-1} (the model at task start) to theta^ft_t,
and the deployed model (evaluated, saved, and the start of the next step) is the weight interpolation

    theta^p_t = (1 - alpha_t) * theta^p_{t-1} + alpha_t * theta^ft_t,        theta^p_1 = theta_1 (alpha_1 = 1)

over every floating-point tensor of the state dict (`logit_scale` included; integer buffers are copied from
theta^ft_t). alpha_t is the value of the grid {0.0, 0.1, ..., 1.0} that maximises the mean validation score over
steps 1..t (the current step included, so that alpha = 0 is not trivially best; `previous_only` scores steps
1..t-1, the paper's wording), ties going to the larger alpha (§7 item 16). The score of a step is retrieval R@1
(the mean of image->text and text->image) for captioned tasks and zero-shot accuracy for class-label tasks, or the
configured `metric`.

**Validation hold-out.** The paper tunes alpha on (probably) its eval sets; we never look at them. Instead,
`validation_size` rows of every task's train split (a seeded sample; a fraction when < 1) are held out of training
when the task trains (`train_dataset`), so **Patching trains on slightly less data than the other strategies**, and
they are kept, as row indices and image ids (never data), for the alpha searches of later steps. On a streaming
train split (an `IterableDataset`) the held-out rows are the stream's first `validation_size` rows (materialised in
memory, re-read by image id after a resume), and training filters them out by image id.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from datasets import Dataset, IterableDataset

from ..data.task import Task
from ..distributed import is_distributed, is_main_process
from ..evaluation.evaluator import evaluate_task
from ..validation import check_count_or_fraction, check_range
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import register_method
from .weight_ensemble import cpu_state_dict, interpolate_state_dicts

logger = logging.getLogger(__name__)

DEFAULT_ALPHAS = [round(0.1 * k, 1) for k in range(11)]


# ----------------------------------------------------------------------------------------------------------------
# Pure pieces: scoring, the grid search (the interpolation is `weight_ensemble.interpolate_state_dicts`, shared
# with `wise_ft`)
# ----------------------------------------------------------------------------------------------------------------
def task_score(metrics: Mapping[str, float], task: Task, metric: str | None = None) -> float:
    """The number alpha is chosen by: `metric` if given, else the task kind's (`TaskKind.selection_score`): R@1
    (mean of both directions) for retrieval tasks and zero-shot accuracy for classification tasks."""
    if metric is not None:
        if metric not in metrics:
            raise ValueError(f"Patching metric {metric!r} is not among {sorted(metrics)} of task {task.name!r}")
        return float(metrics[metric])
    return task.kind_spec.selection_score(metrics)


def select_alpha(alphas: Sequence[float], score: Callable[[float], float]) -> tuple[float, list[tuple[float, float]]]:
    """The alpha of the grid with the highest `score(alpha)`, ties to the larger alpha; also every (alpha, score)."""
    if not alphas:
        raise ValueError("The alpha grid is empty")
    scores = [(float(alpha), float(score(alpha))) for alpha in sorted(alphas)]
    best_alpha, best_score = scores[0]
    for alpha, value in scores[1:]:
        if value >= best_score:  # ascending alphas: ">=" sends ties to the larger one
            best_alpha, best_score = alpha, value
    return best_alpha, scores


def _from_main_process(value: Any) -> Any:
    """`value` of the main process, on every process (unchanged in a single process)."""
    if not is_distributed():
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


# ----------------------------------------------------------------------------------------------------------------
# The validation hold-out
# ----------------------------------------------------------------------------------------------------------------
class ValidationHoldout:
    """The rows of each task's train split kept out of training for choosing alpha (see the module docstring).

    Kept per task index as `rows` (row indices into the train split; empty for a stream) and `image_ids`.
    """

    def __init__(self, size: float, seed: int = 0):
        if size <= 0:
            raise ValueError(f"validation_size must be > 0 (a count, or a fraction < 1), got {size}")
        self.size, self.seed = size, int(seed)
        self.rows: dict[int, list[int]] = {}
        self.image_ids: dict[int, list[str]] = {}
        self._datasets: dict[int, Dataset] = {}  # materialised rows of streaming tasks (not state)

    def count(self, num_rows: int | None) -> int:
        """Rows to hold out of a split of `num_rows` (None: a stream of unknown size)."""
        if self.size < 1:
            if num_rows is None:
                raise ValueError("A fractional validation_size needs the split's size: give a count for streams")
            count = max(1, int(self.size * num_rows))
        else:
            count = int(self.size)
        if num_rows is not None and count >= num_rows:
            raise ValueError(f"validation_size {self.size} leaves no training rows in a split of {num_rows}")
        return count

    def hold_out(self, context: TaskContext) -> None:
        """Choose this task's validation rows (once: a repeated call or a resumed run keeps the stored ones)."""
        index, train = context.task_index, context.task.train
        if index in self.image_ids:
            return
        if isinstance(train, IterableDataset):
            rows = Dataset.from_list(list(train.take(self.count(None))), features=train.features)
            self.rows[index], self.image_ids[index] = [], list(rows["image_id"])
            self._datasets[index] = rows
            return
        rng = np.random.default_rng([self.seed, context.seed, index])
        chosen = np.sort(rng.choice(len(train), size=self.count(len(train)), replace=False)).tolist()
        self.rows[index] = [int(r) for r in chosen]
        self.image_ids[index] = list(train.select(chosen)["image_id"])

    def training_rows(self, context: TaskContext, dataset: Dataset | IterableDataset) -> Dataset | IterableDataset:
        """`dataset` without this task's validation rows."""
        index = context.task_index
        held = set(self.image_ids[index])
        if isinstance(dataset, IterableDataset):
            return dataset.filter(lambda row: row["image_id"] not in held)
        if dataset is context.task.train:
            excluded = set(self.rows[index])
            return dataset.select([r for r in range(len(dataset)) if r not in excluded])
        keep = [i for i, image_id in enumerate(dataset["image_id"]) if image_id not in held]
        return dataset.select(keep)

    def task(self, context: TaskContext, index: int) -> Task:
        """Task `index` of the stream with its validation rows as the eval split."""
        task = context.stream.tasks[index]
        if index not in self.image_ids:
            raise ValueError(f"Task {index} ({task.name!r}) has no validation rows: it was not trained with patching")
        return dataclasses.replace(task, name=f"{task.name}/validation", eval=self._rows(task, index))

    def _rows(self, task: Task, index: int) -> Dataset:
        if not isinstance(task.train, IterableDataset):
            return task.train.select(self.rows[index])
        if index not in self._datasets:  # after a resume: read the stream once more, by image id
            wanted = set(self.image_ids[index])
            found = [row for row in task.train if row["image_id"] in wanted]
            self._datasets[index] = Dataset.from_list(found, features=task.train.features)
        return self._datasets[index]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rows": {str(k): v for k, v in sorted(self.rows.items())},
            "image_ids": {str(k): v for k, v in sorted(self.image_ids.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = {int(k): [int(r) for r in v] for k, v in state["rows"].items()}
        self.image_ids = {int(k): [str(i) for i in v] for k, v in state["image_ids"].items()}
        self._datasets = {}


# ----------------------------------------------------------------------------------------------------------------
# The method
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class PatchingConfig(MethodConfig):
    validation_size: float = field(
        default=64,
        metadata={"help": "Rows of each task's train split held out to choose alpha: a count (>= 1) or a fraction "
                          "(< 1). They are not trained on."},
    )
    alphas: list[float] = field(
        default_factory=lambda: list(DEFAULT_ALPHAS),
        metadata={"help": "The grid of interpolation weights (specs/ticclip.md §7 item 16: 0.0, 0.1, ..., 1.0)."},
    )
    previous_only: bool = field(
        default=False,
        metadata={"help": "Choose alpha on the validation rows of steps 1..t-1 only (default: 1..t, the current "
                          "step included)."},
    )
    metric: str | None = field(
        default=None,
        metadata={"help": "Metric to maximise, a key of evaluate_task's output; None: R@1 (mean of both directions) "
                          "for retrieval tasks, accuracy for classification tasks."},
    )
    eval_batch_size: int = field(default=256, metadata={"help": "Batch size of the validation evaluations."})
    seed: int = field(default=0, metadata={"help": "Seed of the held-out rows, combined with the run's seed."})

    def __post_init__(self) -> None:
        check_range("validation_size", self.validation_size, 0, low_open=True, also="(a count, or a fraction < 1)")
        check_count_or_fraction("validation_size", self.validation_size, "rows", "the task's train split")
        check_range("eval_batch_size", self.eval_batch_size, 1)
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty list in [0, 1], got {self.alphas}")


@register_method
class Patching(ContinualMethod[PatchingConfig]):
    """Sequential patching: train from the last patched model, deploy its interpolation with the fine-tuned one."""

    fsdp_refusal = None  # trains sharded as unsharded (tests/test_fsdp.py)
    name = "patching"
    test_options = {"validation_size": 4}  # a whole batch of 64 still trains on 68-example tasks
    same_step_as = "finetune"
    config_class = PatchingConfig
    roles = {"previous_model": "interpolates each task's fine-tuned model with the previous task's",
             "weight_interpolation": "deploys an interpolation of each task's fine-tuned model with the previous task's"}

    def __init__(self, config: PatchingConfig | dict[str, Any] | None = None):
        super().__init__(config)
        self.validation = ValidationHoldout(self.config.validation_size, seed=self.config.seed)
        self.alphas: dict[int, float] = {}  # task index -> alpha_t
        self.scores: dict[int, list[tuple[float, float]]] = {}  # task index -> [(alpha, score)] of the search
        self._previous: dict[str, torch.Tensor] | None = None  # theta^p_{t-1}, on the CPU

    def on_task_start(self, context: TaskContext) -> None:
        """Snapshot theta^p_{t-1}, the model this task starts from (a CPU copy of its state dict)."""
        self._previous = None if context.task_index == 0 else cpu_state_dict(context.model)

    def train_dataset(self, context: TaskContext, dataset: Dataset) -> Dataset:
        self.validation.hold_out(context)
        return self.validation.training_rows(context, dataset)

    def after_training(self, context: TaskContext) -> None:
        """Deploy θ_{t-1} + α (θ_t − θ_{t-1}) with the α that scores best on the held-out rows (in place)."""
        index = context.task_index
        previous = self._previous
        if index == 0 or previous is None:
            self.alphas[index], self.scores[index] = 1.0, []
            return
        model = context.model
        finetuned = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        steps = range(index) if self.config.previous_only else range(index + 1)
        tasks = [self.validation.task(context, j) for j in steps]

        def score(alpha: float) -> float:
            model.load_state_dict(interpolate_state_dicts(previous, finetuned, alpha))
            return self.validation_score(model, tasks, context)

        # The main process searches (as the loop evaluates there) and every process deploys its alpha.
        found = select_alpha(self.config.alphas, score) if is_main_process() else None
        alpha, scores = _from_main_process(found)
        model.load_state_dict(interpolate_state_dicts(previous, finetuned, alpha))
        self.alphas[index], self.scores[index] = alpha, scores
        self._previous = None
        logger.info("Patching, task %d (%s): alpha = %.2f; validation scores %s", index, context.task.name, alpha,
                    {a: round(s, 4) for a, s in scores})

    def validation_score(self, model: torch.nn.Module, tasks: Sequence[Task], context: TaskContext) -> float:
        """Mean over `tasks` of `task_score` on their validation rows."""
        values = []
        for task in tasks:
            metrics = evaluate_task(
                model, task, context.image_processor, context.tokenizer,
                batch_size=self.config.eval_batch_size, max_length=context.max_length,
            )
            values.append(task_score(metrics, task, self.config.metric))
        return float(np.mean(values))

    def state_dict(self) -> dict[str, Any]:
        """The alpha history (alpha_t and the searched scores per task) and the held-out rows."""
        return {
            "alphas": {str(k): v for k, v in sorted(self.alphas.items())},
            "scores": {str(k): [list(pair) for pair in v] for k, v in sorted(self.scores.items())},
            "validation": self.validation.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alphas = {int(k): float(v) for k, v in state["alphas"].items()}
        self.scores = {int(k): [(float(a), float(s)) for a, s in v] for k, v in state["scores"].items()}
        self.validation.load_state_dict(state["validation"])
