"""The one matrix the tests that must hold for every method run over (accumulation, compile, mixed precision):
every registered method, with the options that let it train in seconds on a tiny CLIP, on the first tasks of the
bundled `digits` stream (68 training examples each: a whole batch of 64 even when `patching` holds 4 out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import available_methods, build_methods
from hf_ccl.testing import tiny_clip

#: Small buffers and queues, so that replay and momentum contrast engage on 64-example tasks.
METHOD_ARGS: dict[str, dict[str, Any]] = {
    "er": {"buffer_size": 16}, "der": {"buffer_size": 16}, "derpp": {"buffer_size": 16},
    "ctp": {"queue_size": 32}, "patching": {"validation_size": 4},
}
METHODS = sorted(available_methods())


class LogRecorder(TrainerCallback):
    """Every `on_log` of every task, as (task number, logs)."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, float]]] = []
        self.task = -1

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.task += 1

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        self.logs.append((self.task, dict(logs or {})))

    def first_step(self, task: int) -> dict[str, float]:
        """The logs of the first logged step of `task` (with `logging_steps=1`)."""
        return next(logs for number, logs in self.logs if number == task and "loss" in logs)


def tiny_stream(tasks: int = 2, train: int = 68, evaluate: int = 8):
    stream = build_stream("digits", max_train_per_task=train, max_eval_per_task=evaluate)
    stream.tasks = stream.tasks[:tasks]
    return stream


def run_method(
    methods: str | list[str], output_dir: Path, training: dict[str, Any], *, tasks: int = 2, seed: int = 1,
    callbacks: list[TrainerCallback] | None = None, **arguments: Any,
) -> ContinualLearner:
    """Fit `methods` (with `METHOD_ARGS`) on `tasks` tiny digits tasks; returns the learner after `fit()`."""
    names = [methods] if isinstance(methods, str) else list(methods)
    args = ContinualArguments(
        output_dir=str(output_dir), training={"logging_steps": 1, **training}, progress=False, seed=seed,
        evaluate_initial=False, save_checkpoints=False, **arguments,
    )
    learner = ContinualLearner(
        tiny_clip(seed=seed), tiny_stream(tasks),
        build_methods(names, {name: METHOD_ARGS[name] for name in names if name in METHOD_ARGS}),
        load_image_processor(32), load_tokenizer(), args, callbacks=callbacks,
    )
    learner.fit()
    return learner
