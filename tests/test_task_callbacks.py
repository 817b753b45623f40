"""Task-level callbacks: the events a user callback sees, in order, with what each carries; `should_stop`; and the
built-in side effects (compute, model card) running as callbacks."""

from __future__ import annotations

import json

import pytest
from transformers import TrainerCallback

from hf_ccl.callbacks import EVENTS, TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip


class Recorder(TaskCallback):
    """Every event as (event, task index, extra keyword names); stops the stream after `stop_after`."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[tuple[str, int, tuple[str, ...]]] = []
        self.stop_after = stop_after
        self.saved_files: list[set[str]] = []

    def _record(self, event: str, state, kwargs) -> None:  # noqa: ANN001
        assert kwargs["learner"] is not None
        self.events.append((event, state.task_index, tuple(sorted(set(kwargs) - {"learner"}))))


def _make_recorder_class() -> type[Recorder]:
    def handler(event: str):  # noqa: ANN202
        def method(self, args, state, control, **kwargs):  # noqa: ANN001, ANN202
            self._record(event, state, kwargs)
            if event == "on_save" and kwargs["task_folder"]:
                self.saved_files.append({path.name for path in kwargs["folder"].iterdir()})
            if event == "on_task_end" and state.task_index == self.stop_after:
                control.should_stop = True
        return method

    return type("EventRecorder", (Recorder,), {event: handler(event) for event in EVENTS})


def _learner(tmp_path, callbacks, tasks: int = 2) -> ContinualLearner:
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:tasks]
    args = ContinualArguments(
        output_dir=str(tmp_path / "run"), progress=False, evaluation={"initial": False},
        training={"per_device_train_batch_size": 8, "num_train_epochs": 1, "logging_steps": 1},
    )
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods("finetune"), load_image_processor(32),
                            load_tokenizer(), args, task_callbacks=callbacks)


def test_events_in_order_with_their_arguments(tmp_path):
    recorder = _make_recorder_class()()
    learner = _learner(tmp_path, [recorder])
    learner.fit()
    names = [event for event, _, _ in recorder.events]
    per_task = ["on_task_begin", "on_train_begin", "on_task_trained", "on_task_evaluated", "on_task_end", "on_save",
                "on_save", "on_checkpoint_saved"]  # the task folder, then the run folder
    assert names == ["on_stream_begin", *per_task, *per_task, "on_save", "on_stream_end"]
    kwargs = {event: keys for event, _, keys in recorder.events}
    assert kwargs["on_train_begin"] == ("collator", "context", "train_dataset", "trainer")
    assert kwargs["on_task_evaluated"] == ("context", "metrics")
    assert kwargs["on_checkpoint_saved"] == ("folder",) and kwargs["on_stream_end"] == ("error",)
    assert [index for event, index, _ in recorder.events if event == "on_task_begin"] == [0, 1]
    # the built-in callbacks wrote their files before the user's on_save saw the folder (the manifest comes after)
    assert {"compute.json", "README.md", "continual_state.json"} <= recorder.saved_files[0]
    assert "checkpoint_manifest.json" not in recorder.saved_files[0]
    compute = json.loads((tmp_path / "run" / "task-1" / "compute.json").read_text())
    assert [record["optimizer_steps"] for record in compute["tasks"]] == [2, 2] == [
        record.optimizer_steps for record in learner.compute]


def test_should_stop_ends_the_stream_after_the_task(tmp_path):
    learner = _learner(tmp_path, [_make_recorder_class()(stop_after=0)])
    matrix = learner.fit()
    assert (tmp_path / "run" / "task-0" / "checkpoint_manifest.json").exists()
    assert not (tmp_path / "run" / "task-1").exists()
    assert [row.label for row in matrix.rows] == [learner.stream[0].name]


def test_stream_end_sees_the_error(tmp_path):
    class Failing(TaskCallback):
        def on_task_trained(self, args, state, control, **kwargs):  # noqa: ANN001
            raise RuntimeError("boom")

    class Ending(TaskCallback):
        error: BaseException | None = None

        def on_stream_end(self, args, state, control, **kwargs):  # noqa: ANN001
            Ending.error = kwargs["error"]

    with pytest.raises(RuntimeError, match="boom"):
        _learner(tmp_path, [Failing(), Ending()], tasks=1).fit()
    assert isinstance(Ending.error, RuntimeError)


def test_a_trainer_callback_is_refused_as_a_task_callback(tmp_path):
    with pytest.raises(TypeError, match="TaskCallback instances, got TrainerCallback"):
        _learner(tmp_path, [TrainerCallback()])
