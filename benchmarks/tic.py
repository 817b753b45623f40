"""TiC-CLIP's protocol at small scale: every strategy gets the same compute per time step (samples seen), and the
model after each step is scored on every step's held-out data.

Strategies (TiC-CLIP Tab. 1): sequential, cumulative_all, cumulative_exp, cumulative_equal, restart, patching, lwf,
ewc at budget C per step; oracle at t*C. Warmup on the first step only, and on every from-scratch run (restart,
oracle); cosine to 0 within each step at the same peak; a fresh optimizer per step. Every strategy's first step is
the same computation (random init, C samples on D_1), as in the paper.

Per strategy: the evaluation matrix E (headline metric: mean R@1-based R_mean for retrieval steps, zero-shot accuracy
for class steps), TiC's ID (diagonal mean), BWT (strict lower triangle) and FWT (strict upper triangle) and their
relative variants (App. F), total samples seen and the MACs estimate (hf_ccl.compute).

Every score of the matrices stands beside its binomial standard error, and a step scored by classification beside
chance and the majority-class rate (`protocol.py`); each strategy's ID and BWT are judged against Sequential's from
runs paired by seed. A time stream has one order (time): `--tasks` picks and orders its steps.

    python benchmarks/tic.py --stream fashion-years [--samples-per-step 2048] [--tasks ...] [--seeds 0,1,2]
        [--output PREFIX] [--runs-dir DIR]

Writes <output>.md/.json (default benchmarks/results/tic_<stream>).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from protocol import (
    BASELINE_NOTE,
    VERDICT_NOTE,
    add_stream_arguments,
    eval_baseline,
    paired_verdict,
    reorder,
    results_path,
    score_table,
    verdict_table,
)

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

RESULTS = Path(__file__).parent / "results"
STRATEGIES = "sequential,cumulative_all,cumulative_exp,cumulative_equal,restart,oracle,patching,lwf,ewc"
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64, "image_size": 32}
SUMMARY_KEYS = ("tic_id", "tic_bwt", "tic_fwt", "tic_rel_bwt", "tic_rel_fwt", "final_average")


def run_strategy(name: str, seed: int, stream, tokenizer, options) -> dict:
    started = time.perf_counter()
    learner = ContinualLearner(
        tiny_clip(seed=seed, **MODEL), stream,
        build_methods([name], {"patching": {"validation_size": options.patching_validation}} if name == "patching"
                      else None),
        load_image_processor(MODEL["image_size"]),
        tokenizer,
        ContinualArguments(
            output_dir=str(options.runs_dir / f"{name}-{seed}"), save_checkpoints=False, progress=False, seed=seed,
            evaluation={"initial": False}, samples_per_task=options.samples_per_step, warmup="first_task",
            training={"per_device_train_batch_size": options.batch_size, "learning_rate": options.lr,
                      "warmup_steps": options.warmup_steps, "lr_scheduler_type": "cosine", "weight_decay": 0.2,
                      "adam_beta2": 0.98, "adam_epsilon": 1e-6, "logging_steps": 50},
        ),
    )
    results = learner.fit()
    summary = results.summary()
    return {
        "strategy": name,
        "seed": seed,
        "matrix": results.headline().tolist(),
        **{key: summary.get(key, math.nan) for key in SUMMARY_KEYS},
        "cost": run_cost(learner.compute),
        "seconds": time.perf_counter() - started,
    }


def aggregate(runs: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == name]
        row = {"strategy": name, "matrix": np.mean([r["matrix"] for r in mine], axis=0).tolist(),
               "cost": mean_run_cost([r["cost"] for r in mine])}
        for key in SUMMARY_KEYS:
            values = np.array([r[key] for r in mine], dtype=float)
            row[key] = float(values.mean())
            row[key + "_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def cell(row: dict, key: str) -> str:
    std = row[key + "_std"]
    return f"{row[key]:.1f}" + (f" ± {std:.1f}" if std else "")


def verdicts(runs: list[dict]) -> list:
    """Each strategy against Sequential of the same seed: higher ID, higher BWT."""
    base = {r["seed"]: r for r in runs if r["strategy"] == "sequential"}
    out = []
    for name in dict.fromkeys(r["strategy"] for r in runs if r["strategy"] != "sequential"):
        mine = [r for r in runs if r["strategy"] == name and r["seed"] in base]
        for key, what in (("tic_id", "ID"), ("tic_bwt", "BWT")):
            if mine:
                out.append(paired_verdict(f"{name}: {what} above sequential", [r[key] for r in mine],
                                          [base[r["seed"]][key] for r in mine]))
    return out


def write(runs: list[dict], stream, options, prefix: Path) -> None:
    rows = aggregate(runs)
    base = next((r for r in rows if r["strategy"] == "sequential"), rows[0])
    names = stream.task_names
    baselines = [eval_baseline(task) for task in stream]
    tasks = f"--tasks {','.join(options.tasks)} " if options.tasks else ""
    lines = [
        f"# TiC-CLIP protocol on `{stream.name}`",
        "",
        f"Command: `python benchmarks/tic.py --stream {options.stream} {tasks}--strategies {options.strategies} "
        f"--samples-per-step {options.samples_per_step} --batch-size {options.batch_size} --lr {options.lr} "
        f"--warmup-steps {options.warmup_steps} "
        + (f"--train-per-step {options.train_per_step} " if options.train_per_step is not None else "")
        + f"--eval-per-step {options.eval_per_step} --patching-validation {options.patching_validation} "
        f"--seeds {','.join(map(str, options.seeds))}`  ",
        f"Random CLIP {MODEL} with the real CLIP vocabulary, trained from scratch on step 1 by every strategy. "
        f"Steps: {', '.join(names)} (train sizes {[len(t.train) for t in stream]}). Compute C = "
        f"{options.samples_per_step} samples per step (batch {options.batch_size}); Oracle t*C. Score per step: "
        f"{', '.join(sorted({t.headline_metric for t in stream}))} (%). Mean ± std over seeds "
        f"{','.join(map(str, options.seeds))}. "
        "ID = mean of the diagonal, BWT = mean of the strict lower triangle (old steps), FWT = strict upper "
        "triangle (future steps), rel- = each row minus its diagonal (TiC App. F).",
        "",
        "| strategy | ID | BWT | FWT | rel-BWT | rel-FWT | final avg | compute vs Sequential | "
        + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (8 + len(RUN_COST_HEADER)) + "|",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {cell(row, 'tic_id')} | {cell(row, 'tic_bwt')} | {cell(row, 'tic_fwt')} | "
            f"{cell(row, 'tic_rel_bwt')} | {cell(row, 'tic_rel_fwt')} | {cell(row, 'final_average')} | "
            f"{row['cost']['macs'] / base['cost']['macs']:.2f}x | {run_cost_cells(row['cost'])} |"
        )
    lines += ["", RUN_COST_NOTE, "", "Claims, each strategy against Sequential of the same seed:", ""]
    lines += verdict_table(verdicts(runs)) + ["", VERDICT_NOTE]
    lines += ["", "Evaluation matrices (rows: model after step i; columns: eval set of step j; seed mean):", ""]
    for row in rows:
        matrix = {label: dict(zip(names, values, strict=True))
                  for label, values in zip(names, row["matrix"], strict=True)}
        lines += [f"**{row['strategy']}**", ""] + score_table("after \\ eval", matrix, baselines) + [""]
    lines += [BASELINE_NOTE]
    results_path(prefix, ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    results_path(prefix, ".json").write_text(
        json.dumps({"summary": rows, "runs": runs, "baselines": [vars(b) for b in baselines]}, indent=2) + "\n",
        encoding="utf-8")
    print("\n".join(lines[:10 + len(rows)]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", default="fashion-years")
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--samples-per-step", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--train-per-step", type=int, default=None)
    parser.add_argument("--eval-per-step", type=int, default=200)
    parser.add_argument("--patching-validation", type=int, default=24, help="rows per step held out to choose alpha")
    add_stream_arguments(
        parser, default_output=str(RESULTS / "tic_{stream}"), orders=(),
        tasks_help="comma-separated step names of --stream (e.g. 2012,2016 for fashion-years), trained in the order "
                   "given (default: every step in time order; TiC's BWT/FWT read the order as time, so keep it)",
    )
    options = parser.parse_args()
    prefix = Path(str(options.output).replace("{stream}", options.stream))
    try:
        stream = build_stream(options.stream, max_train_per_task=options.train_per_step,
                              max_eval_per_task=options.eval_per_step)
        stream = reorder(stream, options.tasks or stream.task_names)
    except ValueError as error:
        parser.error(str(error))
    tokenizer = load_tokenizer()
    runs = []
    for seed in options.seeds:
        for name in options.strategies.split(","):
            runs.append(run_strategy(name, seed, stream, tokenizer, options))
            print(f"{name} seed {seed}: {runs[-1]['seconds']:.0f} s", flush=True)
            write(runs, stream, options, prefix)


if __name__ == "__main__":
    main()
