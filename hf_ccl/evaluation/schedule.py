"""How a continual run evaluates: after which tasks (`eval_every`), on which rows (`eval_max_examples`), and with the
embeddings of towers that did not change reused (`hf_ccl.evaluation.cache`).

`StreamEvaluator` is what `ContinualLearner.evaluate` calls: each task's eval split, or its fixed seeded subsample
(the same rows in every row of the results matrix), scored by `evaluate_task` through one `EmbeddingCache` for the
whole run. `record` writes the protocol into the results matrix and refuses to continue a matrix that was evaluated
on other rows (a resume with another `eval_max_examples` or seed).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np
import torch

from ..class_prompts import CLASS_SCOPES, scope_class_names
from ..data.builders import subsample
from ..data.task import Task
from .cache import EmbeddingCache
from .evaluator import evaluate_task
from .matrix import ResultsMatrix


def evaluated_after(task_index: int, num_tasks: int, every: int) -> bool:
    """Whether the model is evaluated after task `task_index` (0-based): after tasks every-1, 2*every-1, ... and
    always after the last one."""
    if every < 1:
        raise ValueError(f"eval_every must be >= 1, got {every}")
    return (task_index + 1) % every == 0 or task_index == num_tasks - 1


def eval_rows(num_rows: int, max_examples: int | None, seed: int, task_name: str) -> np.ndarray:
    """The eval rows of a task that are scored: all, or a seeded choice of `max_examples` of them (in order), the
    same for a given seed and task name."""
    return subsample(np.arange(num_rows), max_examples, seed, "eval_max_examples", task_name)


class StreamEvaluator:
    """Evaluates every task of a stream, on each task's fixed subsample, reusing unchanged embeddings."""

    def __init__(self, *, eval_every: int = 1, max_examples: int | None = None, seed: int = 0,
                 cache: bool = True, class_scope: str = "task") -> None:
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"eval_max_examples must be >= 1 or None, got {max_examples}")
        evaluated_after(0, 1, eval_every)  # checks eval_every
        if class_scope not in CLASS_SCOPES:
            raise ValueError(f"class_scope must be one of {list(CLASS_SCOPES)}, got {class_scope!r}")
        self.eval_every, self.max_examples, self.seed = eval_every, max_examples, seed
        self.class_scope = class_scope
        self.cache = EmbeddingCache() if cache else None
        self._tasks: dict[str, tuple[weakref.ref, Task]] = {}

    def task(self, task: Task) -> Task:
        """`task` with its eval split cut to the fixed subsample (the same object every time for the same split)."""
        if self.max_examples is None or len(task.eval) <= self.max_examples:
            return task
        held = self._tasks.get(task.name)
        if held is None or held[0]() is not task.eval:
            rows = eval_rows(len(task.eval), self.max_examples, self.seed, task.name)
            held = (weakref.ref(task.eval), dataclasses.replace(task, eval=task.eval.select(rows.tolist())))
            self._tasks[task.name] = held
        return held[1]

    def evaluate(self, model: torch.nn.Module, tasks: Any, image_processor: Any, tokenizer: Any, *,
                 batch_size: int, max_length: int | None, trained: int = 0) -> dict[str, dict[str, float]]:
        """Metrics of `model` on every task (stream order), after training the first `trained` of them; in the
        `"seen"` class scope classification tasks are also scored among the classes of those tasks
        (`seen_accuracy`), in the `"all"` scope among the classes of every task of the stream (`all_accuracy`,
        X-TAIL)."""
        tasks = list(tasks)
        session = None if self.cache is None else self.cache.session(
            model, tokenizer, image_processor, batch_size=batch_size, max_length=max_length)
        return {
            task.name: evaluate_task(
                model, self.task(task), image_processor, tokenizer, batch_size=batch_size, max_length=max_length,
                cache=session,
                seen_class_names=scope_class_names(tasks, trained, task, self.class_scope),
                class_scope=self.class_scope)
            for task in tasks
        }

    def protocol(self, tasks: Any) -> dict[str, Any]:
        """What `record` writes into the results matrix."""
        return {
            "eval_every": self.eval_every,
            "eval_max_examples": self.max_examples,
            "seed": self.seed if self.max_examples is not None else None,
            "examples": {task.name: {"rows": len(task.eval), "evaluated": len(self.task(task).eval)}
                         for task in tasks},
        }

    def record(self, matrix: ResultsMatrix, tasks: Any) -> None:
        """Write the protocol into `matrix`; refuse one whose rows were scored on other eval rows (a resume with
        another eval_max_examples or seed), since its rows and the next ones would not be comparable."""
        protocol = self.protocol(tasks)
        before = matrix.evaluation or {"eval_max_examples": None, "seed": None}
        has_rows = matrix.initial is not None or any(row.evaluated for row in matrix.rows)
        subsample_before = (before.get("eval_max_examples"), before.get("seed"))
        if has_rows and subsample_before != (protocol["eval_max_examples"], protocol["seed"]):
            raise ValueError(
                f"the results so far were evaluated with evaluation.max_examples={subsample_before[0]} (seed "
                f"{subsample_before[1]}), this run evaluates with evaluation.max_examples={protocol['eval_max_examples']} "
                f"(seed {protocol['seed']}): their rows would not be comparable. Resume with the same setting."
            )
        matrix.evaluation = protocol
