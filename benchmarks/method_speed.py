"""Time per training step of each continual-learning method relative to `finetune`, side by side in one run.

Each method runs the same 2-task `digits` stream with the same model init, batch size and data: a short first task
(so teachers, Fisher, buffers exist), then the second task, whose step times are measured. Runs alternate between
methods in rounds so that machine load affects all alike; the table reports the median step time on the second
task and its ratio to `finetune`. With a fixed batch size the per-step ratio is also the per-sample ratio (replay
methods train on more samples per task, not on bigger batches). A second table times a whole 5-epoch second task
for finetune vs Mod-X with and without the teacher-feature cache.

    python benchmarks/method_speed.py [--steps 40] [--rounds 3] [--size default]

Writes benchmarks/results/method_speed.md. Goals (issue 3): Mod-X and LwF <= 1.35x, CTP <= 1.7x, EWC/SI/MAS
<= 1.15x, ER/DER <= 1.10x per sample, Mod-X with the cache <= 1.15x over a 5-epoch task.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import available_methods, build_methods
from hf_ccl.testing import tiny_clip

SIZES = {
    "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "projection_dim": 32},
    "default": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64},
}
# (label, methods, method_args, goal)
CANDIDATES = [
    ("finetune", ["finetune"], {}, None),
    ("modx", ["modx"], {}, 1.35),
    ("modx (teacher cache)", ["modx"], {"modx": {"teacher_cache": True}}, 1.35),
    ("lwf", ["lwf"], {}, 1.35),
    ("ctp", ["ctp"], {}, 1.7),
    ("ctp (teacher cache)", ["ctp"], {"ctp": {"teacher_cache": True}}, 1.7),
    ("ewc", ["ewc"], {}, 1.15),
    ("si", ["si"], {}, 1.15),
    ("mas", ["mas"], {}, 1.15),
    ("er", ["er"], {}, 1.10),
    ("der", ["der"], {}, 1.10),
    ("derpp", ["derpp"], {}, 1.10),
    ("modx + er", ["modx", "er"], {}, None),
    ("ctp + er", ["ctp", "er"], {}, None),
]
BATCH_SIZE = 32
WARMUP = 3


class TaskStepTimer(TrainerCallback):
    """Step end times of the last task trained, and its whole training time."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.task_seconds = 0.0
        self._start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self.stamps = []
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.stamps.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.task_seconds = time.perf_counter() - self._start

    def step_times(self) -> list[float]:
        stamps = self.stamps[WARMUP:]
        return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def run_once(methods, method_args, stream, tokenizer, size, training) -> TaskStepTimer:
    timer = TaskStepTimer()
    args = ContinualArguments(
        output_dir="/tmp/hf_ccl_method_speed", training=training, evaluate_initial=False, save_checkpoints=False,
        progress=False, first_task_epochs=None,
    )
    learner = ContinualLearner(
        tiny_clip(seed=0, **SIZES[size]), stream, build_methods(methods, method_args), load_image_processor(32),
        tokenizer, args, callbacks=[timer],
    )
    learner.fit()
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps timed on the second task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "method_speed.md"))
    args = parser.parse_args()

    registered = set(available_methods())
    candidates = [c for c in CANDIDATES if set(c[1]) <= registered]
    skipped = [c[0] for c in CANDIDATES if not set(c[1]) <= registered]
    tokenizer = load_tokenizer()
    stream = build_stream("digits", max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    training = {"max_steps": args.steps + WARMUP + 1, "per_device_train_batch_size": BATCH_SIZE, "learning_rate": 1e-3}

    times: dict[str, list[float]] = {label: [] for label, *_ in candidates}
    for _ in range(args.rounds):
        for label, methods, method_args, _goal in candidates:
            times[label] += run_once(methods, method_args, stream, tokenizer, args.size, training).step_times()
            print(f"{label}: {statistics.median(times[label]) * 1e3:.1f} ms/step so far", flush=True)

    base = statistics.median(times["finetune"])
    lines = [
        "# Time per training step of each method vs `finetune`",
        "",
        f"Command: `python benchmarks/method_speed.py --steps {args.steps} --rounds {args.rounds} --size {args.size}`  ",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Second task of `digits` (first task trained "
        f"first so teachers/Fisher/buffers exist), batch {BATCH_SIZE}, {args.steps} steps x {args.rounds} rounds, "
        f"median of step times, first {WARMUP} steps of each run dropped.",
        "",
        "| method | ms/step (median) | ratio vs finetune | goal | met |",
        "|---|---|---|---|---|",
    ]
    for label, _methods, _args, goal in candidates:
        median = statistics.median(times[label])
        ratio = median / base
        met = "" if goal is None else ("yes" if ratio <= goal else "**no**")
        lines.append(f"| {label} | {median * 1e3:.1f} | {ratio:.2f} | {'' if goal is None else f'<= {goal:.2f}'} | {met} |")
    if skipped:
        lines += ["", f"Not registered when this ran: {', '.join(skipped)}."]

    epoch_rows = [c for c in candidates if c[0] in ("finetune", "modx", "modx (teacher cache)")]
    if len(epoch_rows) == 3:
        epoch_training = {"num_train_epochs": 5, "per_device_train_batch_size": BATCH_SIZE, "learning_rate": 1e-3}
        totals = {label: [] for label, *_ in epoch_rows}
        for _ in range(args.rounds):
            for label, methods, method_args, _goal in epoch_rows:
                timer = run_once(methods, method_args, stream, tokenizer, args.size, epoch_training)
                totals[label].append(timer.task_seconds)
        base_total = statistics.median(totals["finetune"])
        lines += [
            "",
            "## A whole 5-epoch second task (teacher-feature cache: the old model encodes each example once per task)",
            "",
            "| method | seconds (median) | ratio vs finetune |",
            "|---|---|---|",
        ]
        for label in totals:
            total = statistics.median(totals[label])
            lines.append(f"| {label} | {total:.2f} | {total / base_total:.2f} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
