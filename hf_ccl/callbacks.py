"""Task-level callbacks: the continual loop's side effects, and the user's own, in the style of `TrainerCallback`.

`ContinualLearner` runs the stream; everything it does besides training, evaluating and keeping method state is a
`TaskCallback`: Hub pushes (`hf_ccl.hub.HubPushCallback`), model cards (`hf_ccl.cards.ModelCardCallback`),
Mod-X's spatial-disorder diagnostics (`hf_ccl.evaluation.spatial_disorder.SpatialDisorderCallback`) and the compute
accounting (`hf_ccl.compute.ComputeCallback`). Users pass their own with `ContinualLearner(..., task_callbacks=[...])`.

Every event has the signature `on_<event>(self, args, state, control, **kwargs)`, as a `TrainerCallback`'s: `args`
the run's `ContinualArguments`, `state` a `StreamState` (where the stream is), `control` a `StreamControl` (what the
loop should do next), and keyword arguments that depend on the event (`learner` always):

| event                 | when                                                              | kwargs                     |
|-----------------------|-------------------------------------------------------------------|----------------------------|
| `on_stream_begin`     | `fit()` starts, after a resume was restored                       | `learner`                  |
| `on_task_begin`       | before the methods' `on_task_start`                               | `context`                  |
| `on_train_begin`      | the task's Trainer is built, before it trains                     | `context`, `trainer`,      |
|                       |                                                                   | `collator`, `train_dataset`|
| `on_task_trained`     | after training and the methods' `after_training`                  | `context`, `trainer`       |
| `on_task_evaluated`   | the task's row was added (not after tasks `eval_every` skips)     | `context`, `metrics`       |
| `on_task_end`         | after the methods' `on_task_end`, before the checkpoint           | `context`                  |
| `on_save`             | a checkpoint (`task_folder=True`) or the run folder is written:   | `folder`, `task_folder`    |
|                       | add files to `folder` (main process; before the manifest)         |                            |
| `on_restore`          | a task checkpoint is restored (every process)                     | `folder`                   |
| `on_checkpoint_saved` | `task-<k>/` is complete (main process)                            | `folder`                   |
| `on_stream_end`       | `fit()` ends, also when it fails (`error` is then the exception)  | `error`                    |

Callbacks run in the order given, after the built-in ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EVENTS = (
    "on_stream_begin", "on_task_begin", "on_train_begin", "on_task_trained", "on_task_evaluated", "on_task_end",
    "on_save", "on_restore", "on_checkpoint_saved", "on_stream_end",
)


@dataclass
class StreamState:
    """Where the stream is: the task being run (-1 before the first), optimizer steps over the stream so far, the
    task checkpoint the run resumed from, and the last one written."""

    num_tasks: int
    task_index: int = -1
    task_name: str | None = None
    global_step: int = 0
    resumed_from: Path | None = None
    last_checkpoint: Path | None = None


@dataclass
class StreamControl:
    """What a callback asks of the loop: `should_stop` ends the stream after the current task (its checkpoint is
    written first)."""

    should_stop: bool = False


class TaskCallback:
    """Base class: every event is a no-op, so a callback overrides only the events it needs."""

    def on_stream_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_train_begin(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_trained(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_evaluated(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_task_end(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_save(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_restore(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_checkpoint_saved(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...

    def on_stream_end(self, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None: ...


@dataclass
class TaskCallbackHandler:
    """Calls one event on every callback, in order (as transformers' `CallbackHandler`)."""

    callbacks: list[TaskCallback] = field(default_factory=list)

    def __post_init__(self) -> None:
        for callback in self.callbacks:
            check_callback(callback)

    def add(self, callbacks: Sequence[TaskCallback]) -> None:
        for callback in callbacks:
            check_callback(callback)
            self.callbacks.append(callback)

    def get(self, kind: type[TaskCallback]) -> TaskCallback | None:
        """The first callback of type `kind`, or None."""
        return next((callback for callback in self.callbacks if isinstance(callback, kind)), None)

    def call(self, event: str, args: Any, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"Unknown task event {event!r}; events: {', '.join(EVENTS)}")
        for callback in self.callbacks:
            getattr(callback, event)(args, state, control, **kwargs)


def check_callback(callback: Any) -> None:
    """A task callback is a `TaskCallback` (a `TrainerCallback` belongs in `callbacks`, given to every Trainer)."""
    if not isinstance(callback, TaskCallback):
        raise TypeError(f"task_callbacks takes TaskCallback instances, got {type(callback).__name__} (a "
                        "transformers TrainerCallback goes in `callbacks`)")
