"""A small 3-task continual run for the resume tests, runnable in a subprocess.

    python resumable_run.py OUTPUT_DIR METHODS [--kill-at-step N --kill-task K] [--resume] [--hub-model-id REPO]

`--kill-task K --kill-at-step N` sends SIGKILL to this very process at global step N of task K (after the Trainer
checkpoint of that step was written), like a machine that dies mid-task. Writes OUTPUT_DIR/final_results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the method matrix
from method_matrix import method_args  # noqa: E402

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.distributed import is_main_process
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

TRAINING = {
    "num_train_epochs": 2, "per_device_train_batch_size": 16, "learning_rate": 1e-3, "warmup_steps": 0.1,
    "lr_scheduler_type": "cosine", "save_strategy": "steps", "save_steps": 3, "logging_steps": 2,
}


def small_stream():
    stream = build_stream("digits", max_train_per_task=48, max_eval_per_task=24)
    stream.tasks = stream.tasks[:3]
    return stream


class KillAt(TrainerCallback):
    """SIGKILL this process at a given step of a given task, right after the Trainer saved that step."""

    def __init__(self, learner_ref: list, task: int, step: int):
        self.learner_ref, self.task, self.step = learner_ref, task, step
        self.task_seen = -1

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self.task_seen += 1

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.task_seen == self.task and state.global_step >= self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def build_learner(output_dir: str, methods: list[str], resume: bool, hub_model_id: str | None,
                  callbacks: list) -> ContinualLearner:
    args = ContinualArguments(
        output_dir=output_dir, training=dict(TRAINING), progress=False, seed=3,
        resume_from_checkpoint=True if resume else None, hub={"model_id": hub_model_id, "backoff": 0.05},
    )
    return ContinualLearner(
        tiny_clip(seed=3), small_stream(), build_methods(methods, method_args(methods)),
        load_image_processor(32), load_tokenizer(), args, callbacks=callbacks,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("methods")
    parser.add_argument("--kill-task", type=int)
    parser.add_argument("--kill-at-step", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hub-model-id")
    options = parser.parse_args()
    callbacks = []
    if options.kill_task is not None:
        # on resume the interrupted task starts at the Trainer checkpoint, so count tasks from the resumed one
        callbacks.append(KillAt([], options.kill_task, options.kill_at_step))
    learner = build_learner(options.output_dir, options.methods.split("+"), options.resume, options.hub_model_id,
                            callbacks)
    results = learner.fit()
    payload = {"matrix": results.to_dict()}
    if learner.push_report is not None:
        payload["pushed"] = [r.task_index for r in learner.push_report.records if r.pushed]
        payload["failed"] = [r.task_index for r in learner.push_report.failed]
    if is_main_process():
        (Path(options.output_dir) / "final_results.json").write_text(json.dumps(payload), encoding="utf-8")


if __name__ == "__main__":
    main()
