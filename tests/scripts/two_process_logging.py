"""Run under `accelerate launch --multi_gpu --num_processes 2` (gloo, CPU) by tests/test_stream_logging.py: a 2-task
continual run with `report_to: [tensorboard]`; writes `rank<r>.json` (world size, global step) into the folder given
as the first argument, and the run into its `run/` sub-folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accelerate import PartialState

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip


def main() -> None:
    output_dir = Path(sys.argv[1])
    state = PartialState(cpu=True)
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=16)
    stream.tasks = stream.tasks[:2]
    args = ContinualArguments(
        output_dir=str(output_dir / "run"), progress=False, save_checkpoints=False,
        training={"max_steps": 3, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "logging_steps": 1,
                  "report_to": ["tensorboard"]},
    )
    learner = ContinualLearner(tiny_clip(seed=0), stream, build_methods(["finetune"]), load_image_processor(32),
                               load_tokenizer(), args)
    learner.fit()
    report = {"world_size": state.num_processes, "global_step": learner.global_step}
    (output_dir / f"rank{state.process_index}.json").write_text(json.dumps(report), encoding="utf-8")


if __name__ == "__main__":
    main()
