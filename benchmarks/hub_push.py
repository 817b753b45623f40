"""What a task's Hub push adds to a run: the same 5-task `digits` run without a Hub, then pushing every task to the
local Hub server (hf_ccl.testing), with no added latency and with a slow Hub (every request delayed).

Pushes run on a background thread, so the run only waits for the last push at the end. Per setting: the run's wall
time and its ratio to the run without a Hub, the seconds each push took (on the background thread), the size of a
task checkpoint, and the commits the server received.

    python benchmarks/hub_push.py [--delay 0.2] [--size default]

Writes benchmarks/results/hub_push.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.testing import FaultPlan, LocalHubServer, tiny_clip

SIZES = {
    "tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "projection_dim": 32},
    "default": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64},
}


def run_once(output_dir: Path, size: str, repo: str | None) -> tuple[float, ContinualLearner]:
    stream = build_stream("digits", max_train_per_task=200, max_eval_per_task=60)
    args = ContinualArguments(
        output_dir=str(output_dir), progress=False, seed=0, hub={"model_id": repo},
        training={"num_train_epochs": 2, "per_device_train_batch_size": 32, "learning_rate": 1e-3},
    )
    learner = ContinualLearner(tiny_clip(seed=0, **SIZES[size]), stream, build_methods(["er"]),
                               load_image_processor(32), load_tokenizer(), args)
    started = time.perf_counter()
    learner.fit()
    return time.perf_counter() - started, learner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds added to every request of the slow Hub")
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "hub_push.md"))
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, _ = run_once(tmp / "no-hub", options.size, None)
        rows.append(("no Hub", base, None, None, None))
        checkpoint_mb = sum(f.stat().st_size for f in (tmp / "no-hub" / "task-0").rglob("*") if f.is_file()) / 1e6
        for label, plan in (("local Hub", FaultPlan()),
                            (f"slow Hub (+{options.delay:g} s per request)", FaultPlan(delay_s=options.delay,
                                                                                   only_methods=None))):
            with LocalHubServer(tmp / f"hub-{len(rows)}", faults=plan) as server, \
                    server.patch_client(cache_dir=tmp / f"cache-{len(rows)}"):
                seconds, learner = run_once(tmp / f"run-{len(rows)}", options.size, f"bench/clip-{len(rows)}")
                report = learner.push_report
                commits = sum(1 for r in server.request_log if r.method == "POST" and "/commit/" in r.path)
                pushes = [r.seconds for r in report.records]
                rows.append((label, seconds, statistics.median(pushes), len(report.failed), commits))
    lines = [
        "# What a task's Hub push adds to a run",
        "",
        f"Command: `python benchmarks/hub_push.py --delay {options.delay:g} --size {options.size}`  ",
        f"5-task `digits` run with `er` (200 train examples per task, 2 epochs, batch 32), model {SIZES[options.size]};"
        f" a task checkpoint is {checkpoint_mb:.1f} MB (model, processor, method state, results, card). The Hub is "
        "`hf_ccl.testing.LocalHubServer` on 127.0.0.1. Pushes run on a background thread while the next task trains.",
        "",
        "| setting | run wall time (s) | ratio vs no Hub | push time per task, background (s, median) | failed pushes "
        "| commits received |",
        "|---|---|---|---|---|---|",
    ]
    for label, seconds, push, failed, commits in rows:
        lines.append(f"| {label} | {seconds:.1f} | {seconds / base:.2f} | {'' if push is None else f'{push:.2f}'} | "
                     f"{'' if failed is None else failed} | {'' if commits is None else commits} |")
    text = "\n".join(lines) + "\n"
    Path(options.output).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
