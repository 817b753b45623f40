"""Evaluation's share of a continual run's wall time, on bundled recipes and 5- and 10-task streams.

Each run goes through `hf_ccl.run.run` (the path `hf-ccl train` takes), in this process, with two timers patched in at
class level: `ContinualLearner.evaluate` (every evaluation pass: the initial row and one per evaluated task) and
`ContinualLearner._train_task` (each task's Trainer run). The rest of the wall time (stream and model building, method
hooks, checkpoints) is reported as "other".

Recipes whose training takes many minutes on 2 CPU cores run with fewer epochs (`--quick`, the default; `--full` runs
every recipe as shipped). Evaluation does not depend on the epochs, and a task's training time is proportional to
them, so each quick run also reports the *projected* share at the recipe's epochs: training time x (recipe epochs /
run epochs), task by task. By default: digits (5 tasks) and flickr8k-random5 split into 5 and 10 tasks.

    .venv/bin/python benchmarks/eval_share.py --label before            # quick runs; appends to eval_share.json
    .venv/bin/python benchmarks/eval_share.py --label after-every2 --set evaluation.every=2
    .venv/bin/python benchmarks/eval_share.py --full --label full       # every recipe as shipped (idle machine)
    .venv/bin/python benchmarks/eval_share.py --runs digits,flickr8k-random10 --label check

Writes benchmarks/results/eval_share.json (all labels so far) and benchmarks/results/eval_share.md (one table per
label, with its command and the machine's load average when it ran). Times taken on a loaded machine are noisy:
compare shares, and compare labels measured under similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_ccl.config import load_config
from hf_ccl.continual import ContinualLearner
from hf_ccl.run import run

RESULTS = Path(__file__).resolve().parent / "results"
GOAL = 0.20


@dataclass
class Run:
    """One measured run: a bundled recipe, with overrides; `quick` overrides shorten training only."""

    name: str
    recipe: str
    overrides: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=list)
    note: str = ""


DEFAULT_RUNS = ("digits", "flickr8k-random5", "flickr8k-random10")
RUNS = [
    Run("digits", "digits", quick=["training.num_train_epochs=2"], note="5 classification tasks"),
    Run("custom-stream", "custom-stream", quick=["training.num_train_epochs=1"], note="3 classification tasks"),
    Run("pacs-domains", "pacs-domains", quick=["first_task_epochs=1", "training.num_train_epochs=1"],
        note="4 classification tasks"),
    Run("domains5", "domains5", quick=["first_task_epochs=1", "training.num_train_epochs=1"],
        note="5 mixed tasks"),
    Run("flickr8k-random5", "flickr8k-random5", quick=["first_task_epochs=1", "training.num_train_epochs=1"],
        note="5 retrieval tasks"),
    Run("flickr8k-random10", "flickr8k-random5", overrides=["stream_args.n_tasks=10"],
        quick=["first_task_epochs=1", "training.num_train_epochs=1"], note="the same split into 10 tasks"),
]


class Timers:
    """Wall-clock seconds of every `evaluate` call and of each task's training, patched in at class level."""

    def __init__(self) -> None:
        self.evaluate: list[float] = []
        self.train: list[tuple[int, float]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Timers:
        evaluate, train_task = ContinualLearner.evaluate, ContinualLearner._train_task
        self._saved = {"evaluate": evaluate, "_train_task": train_task}
        timers = self

        def timed_evaluate(learner: ContinualLearner, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return evaluate(learner, *args, **kwargs)
            finally:
                timers.evaluate.append(time.perf_counter() - start)

        def timed_train(learner: ContinualLearner, context: Any) -> Any:
            start = time.perf_counter()
            try:
                return train_task(learner, context)
            finally:
                timers.train.append((context.task_index, time.perf_counter() - start))

        ContinualLearner.evaluate = timed_evaluate  # type: ignore[method-assign]
        ContinualLearner._train_task = timed_train  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self._saved.items():
            setattr(ContinualLearner, name, value)


def _epochs(config: Any, task_index: int) -> float:
    if task_index == 0 and config.first_task_epochs is not None:
        return float(config.first_task_epochs)
    return float(config.training.get("num_train_epochs", 1))


def measure(spec: Run, quick: bool, extra: list[str], workdir: Path) -> dict[str, Any]:
    """Run one recipe and return its times, shares and the projection to the recipe's epochs."""
    shipped = load_config(spec.recipe, spec.overrides)
    overrides = [*spec.overrides, *(spec.quick if quick else []), *extra,
                 f"output_dir={workdir / spec.name}", "progress=false"]
    config = load_config(spec.recipe, overrides)
    with Timers() as timers:
        start = time.perf_counter()
        results = run(config)
        total = time.perf_counter() - start
    evaluation, train = sum(timers.evaluate), sum(seconds for _, seconds in timers.train)
    projected_train = sum(seconds * _epochs(shipped, index) / _epochs(config, index) for index, seconds in timers.train)
    projected_total = total - train + projected_train
    rows = [row for row in results.rows if getattr(row, "evaluated", True)]
    return {
        "run": spec.name, "recipe": spec.recipe, "note": spec.note, "overrides": overrides[:-2],
        "tasks": results.num_tasks, "evaluations": len(timers.evaluate), "evaluated_rows": len(rows),
        "total_s": total, "train_s": train, "eval_s": evaluation, "other_s": total - train - evaluation,
        "share": evaluation / total, "shortened": quick and bool(spec.quick),
        "projected_total_s": projected_total, "projected_share": evaluation / projected_total,
        "final_average": results.summary().get("final_average"),
    }


def _load_average() -> str:
    try:
        return " / ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


def _table(entry: dict[str, Any]) -> list[str]:
    lines = [
        f"### {entry['label']}", "",
        f"Command: `{entry['command']}`  ",
        f"Machine: {entry['machine']}; load average (1/5/15 min) before: {entry['load_before']}, after: "
        f"{entry['load_after']}.", "",
        "| run | tasks | shortened | evaluations | total (s) | train (s) | eval (s) | other (s) | eval share | "
        "projected share at the recipe's epochs | final average |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_ in entry["runs"]:
        projected = f"{100 * run_['projected_share']:.1f}%" if run_["shortened"] else "(as shipped)"
        final = run_["final_average"]
        lines.append(
            f"| {run_['run']} | {run_['tasks']} | {'yes' if run_['shortened'] else 'no'} | {run_['evaluations']} | "
            f"{run_['total_s']:.1f} | {run_['train_s']:.1f} | {run_['eval_s']:.1f} | {run_['other_s']:.1f} | "
            f"{100 * run_['share']:.1f}% | {projected} | {'-' if final is None else f'{final:.2f}'} |"
        )
    return lines


def write_markdown(entries: list[dict[str, Any]], path: Path) -> None:
    lines = [
        "# Evaluation's share of a continual run", "",
        "Measured by `benchmarks/eval_share.py`: wall time of `hf_ccl.run.run` split into training (each task's "
        "Trainer run), evaluation (every `ContinualLearner.evaluate` call: the initial row and each evaluated task's "
        "row) and other (building, hooks, checkpoints). Goal (issue 14): evaluation at most "
        f"{100 * GOAL:.0f}% of the wall time of each bundled recipe.", "",
        "\"Shortened\" runs train 1 epoch per task instead of the recipe's; their \"projected share\" scales each "
        "task's measured training time to the recipe's epochs (evaluation does not depend on them).", "",
        "The machine has 2 cores shared with other jobs: absolute times are noisy (2-6x), shares less so. Compare "
        "labels taken under similar load (the load average is given).", "",
    ]
    for entry in entries:
        lines += _table(entry) + [""]
        if entry.get("comment"):
            lines += [entry["comment"], ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="Name of this measurement (e.g. before, after).")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                        help=f"Comma-separated run names among {[run_.name for run_ in RUNS]}, or 'all'.")
    parser.add_argument("--full", action="store_true", help="Run every recipe as shipped (minutes to hours).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="A config override for every run (e.g. evaluation.every=2).")
    parser.add_argument("--comment", default="", help="A note printed under this label's table.")
    parser.add_argument("--output", type=Path, default=RESULTS / "eval_share",
                        help="path prefix of the results files (.json, .md); default %(default)s")
    args = parser.parse_args(argv)
    chosen = [run_.name for run_ in RUNS] if args.runs == "all" else args.runs.split(",")
    unknown = sorted(set(chosen) - {run_.name for run_ in RUNS})
    if unknown:
        parser.error(f"unknown run(s) {unknown}; choose among {[run_.name for run_ in RUNS]}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = _load_average()
    measured = []
    with tempfile.TemporaryDirectory(prefix="eval-share-") as tmp:
        for spec in (run_ for run_ in RUNS if run_.name in chosen):
            print(f"== {spec.name}", flush=True)
            result = measure(spec, quick=not args.full, extra=args.set, workdir=Path(tmp))
            print(json.dumps(result), flush=True)
            measured.append(result)
    entry = {
        "label": args.label,
        "command": "python benchmarks/eval_share.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "machine": f"{platform.machine()}, {os.cpu_count()} threads, torch {torch.__version__}",
        "load_before": load_before, "load_after": _load_average(), "comment": args.comment, "runs": measured,
    }
    out_json = args.output.with_name(args.output.name + ".json")
    entries = json.loads(out_json.read_text()) if out_json.exists() else []
    entries = [item for item in entries if item["label"] != args.label] + [entry]
    entries.sort(key=lambda item: item["label"] != "before")  # "before" first, then in the order measured
    out_json.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
    write_markdown(entries, args.output.with_name(args.output.name + ".md"))


if __name__ == "__main__":
    main()
