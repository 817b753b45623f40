"""Do the methods keep what was learned? Every method on the same stream, same model init, same epochs per task.

A random CLIP is pretrained on the first task (`--first-epochs`), then trained on the rest of the stream with each
method, in every order of `--order` (the stream's own order `I` and a seeded random one) and every seed. Per method:
the final average of the headline metric and of Recall@1 (mean of both directions, retrieval tasks), backward
transfer and forgetting (on the headline metric), plasticity (the headline score on each task right after training
it), the first trained task's headline score right after it and after the last task, Mod-X's kept-row fraction, and
the median step time relative to `finetune` from the same run; each method's final score per task beside chance,
the majority-class rate and its standard error (`protocol.py`); and verdicts on "forgets less than finetune" and
"ends higher than finetune", paired by (order, seed). Plot: the first trained task's score after every task.

`--size start` starts every run from the benchmarks' cached starting model (`pretrain_start.py`) instead, every task
trained `--epochs`. A method takes options in its spec (`modx:alpha=5`, `+` joins methods: `modx:alpha=5+er`), so a
sweep is a list of specs. Every run also reports the control: the model's Flickr8k-en test retrieval (R_mean on
`--control-examples` images) after the last task, and whether a method keeps it better than finetune.

    python benchmarks/forgetting.py --stream flickr8k-random5 [--methods finetune,modx,...] [--order I,random]
        [--tasks ...] [--seeds 0,1,2] [--output PREFIX] [--runs-dir DIR]

Writes <output>.md/.json/.png (default benchmarks/results/forgetting_<stream>).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from pretrain_start import DEFAULT_CACHE, MODEL, RECIPE, ensure_start_model, load_start_model
from protocol import (
    BASELINE_NOTE,
    VERDICT_NOTE,
    ControlRetrieval,
    add_stream_arguments,
    control_task,
    eval_baseline,
    paired_verdict,
    plasticity,
    reorder,
    results_path,
    score_table,
    task_orders,
    verdict_table,
)
from transformers import TrainerCallback

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

METHODS = "finetune,joint,modx,ctp,lwf,ewc,si,mas,er,derpp,modx+er,ctp+er"
RESULTS = Path(__file__).parent / "results"
SIZES = {
    "default": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64, "image_size": 32},
    # 8M parameters besides the token embedding, at the bundled images' full 64 px
    "medium": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "projection_dim": 128, "image_size": 64,
               "patch_size": 8},
}


class StepLog(TrainerCallback):
    """Step times of every task, and Mod-X's kept fraction from the logs."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self.kept: list[float] = []
        self._last = None

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self._last = None

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        now = time.perf_counter()
        if self._last is not None:
            self.step_times.append(now - self._last)
        self._last = now

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if logs and "modx/kept_fraction" in logs:
            self.kept.append(logs["modx/kept_fraction"])


def recall_at_1(metrics: dict[str, float]) -> float:
    """Mean of image-to-text and text-to-image R@1, NaN for tasks scored by classification."""
    if "i2t_R@1" not in metrics:
        return math.nan
    return (metrics["i2t_R@1"] + metrics["t2i_R@1"]) / 2


def parse_spec(spec: str) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """`"modx:alpha=5+er"` -> (["modx", "er"], {"modx": {"alpha": 5.0}}): methods joined by `+`, each with
    `:key=value,...` options (numbers where they parse as numbers)."""
    names, options = [], {}
    for part in spec.split("+"):
        name, _, rest = part.partition(":")
        names.append(name)
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            try:
                options.setdefault(name, {})[key] = float(value) if "." in value or "e" in value else int(value)
            except ValueError:
                options.setdefault(name, {})[key] = value
    return names, options


def method_args(names: list[str], buffer_size: int, options: dict[str, dict[str, Any]] | None = None) -> dict:
    args = {}
    for name in names:
        if name in ("er", "der", "derpp"):
            args[name] = {"buffer_size": buffer_size}
        if name == "ctp":
            args[name] = {"queue_size": 256}
    for name, values in (options or {}).items():
        args[name] = {**args.get(name, {}), **values}
    return args


def starting_model(args, seed: int):
    """A random CLIP of `--size`, or (`--size start`) the cached pretrained starting model."""
    if args.size == "start":
        return copy.deepcopy(args.start)
    return tiny_clip(seed=seed, **SIZES[args.size])


def run_method(spec: str, order: str, seed: int, stream, tokenizer, args) -> dict:
    names, options = parse_spec(spec)
    log, kept = StepLog(), ControlRetrieval(args.control)
    model = starting_model(args, seed)
    learner = ContinualLearner(
        model, stream, build_methods(names, method_args(names, args.buffer_size, options)),
        load_image_processor(model.config.vision_config.image_size), tokenizer,
        ContinualArguments(
            output_dir=str(args.runs_dir / f"{spec.replace(':', '_')}-{order}-seed{seed}"), save_checkpoints=False,
            progress=False, seed=seed, first_task_epochs=None if args.size == "start" else args.first_epochs,
            training={"num_train_epochs": args.epochs, "per_device_train_batch_size": args.batch_size,
                      "learning_rate": args.lr, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                      "weight_decay": 0.0},
        ),
        callbacks=[log], task_callbacks=[kept],
    )
    results = learner.fit()
    task_names = stream.task_names
    r1 = np.array([[recall_at_1(row.metrics[name]) for name in task_names] for row in results.rows])
    headline = results.headline()
    summary = results.summary()
    return {
        "method": spec,
        "order": order,
        "seed": seed,
        "tasks": task_names,
        "headline": headline.tolist(),
        "recall_at_1": r1.tolist(),
        "final_average": summary["final_average"],
        "final_average_R@1": float(np.nanmean(r1[-1])) if not np.all(np.isnan(r1[-1])) else math.nan,
        "backward_transfer": summary["backward_transfer"],
        "forgetting": summary["forgetting"],
        "plasticity": plasticity(headline),
        "first_task_initial": float(headline[0, 0]),
        "first_task_final": float(headline[-1, 0]),
        "median_step_s": statistics.median(log.step_times) if log.step_times else math.nan,
        "modx_kept_fraction": statistics.mean(log.kept) if log.kept else None,
        "control": kept.scores, "control_last": kept.scores[-1],
        "cost": run_cost(learner.compute),
    }


SCALARS = ("final_average", "final_average_R@1", "backward_transfer", "forgetting", "plasticity",
           "first_task_initial", "first_task_final", "control_last", "step_ratio")


def aggregate(runs: list[dict]) -> list[dict]:
    """Mean and standard deviation over runs (orders x seeds) per method; step times as ratios to `finetune` of
    the same order and seed."""
    base = {(r["order"], r["seed"]): r["median_step_s"] for r in runs if r["method"] == "finetune"}
    for r in runs:
        r["step_ratio"] = r["median_step_s"] / base.get((r["order"], r["seed"]), math.nan)
    rows = []
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        row = {"method": method, "runs": [[r["order"], r["seed"]] for r in mine]}
        for key in SCALARS:
            values = np.array([r[key] for r in mine], dtype=float)
            row[key] = float(np.mean(values))
            row[key + "_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        kept = [r["modx_kept_fraction"] for r in mine if r["modx_kept_fraction"] is not None]
        row["modx_kept_fraction"] = statistics.fmean(kept) if kept else None
        row["cost"] = mean_run_cost([r["cost"] for r in mine])
        row["first_task_curve"] = np.mean([[x[0] for x in r["headline"]] for r in mine], axis=0).tolist()
        finals = [dict(zip(r["tasks"], r["headline"][-1], strict=True)) for r in mine]
        row["final_per_task"] = {task: float(np.mean([f[task] for f in finals])) for task in finals[0]}
        rows.append(row)
    return rows


def verdicts(runs: list[dict]) -> list:
    """Each method against `finetune` of the same order and seed: forgets less, ends higher."""
    base = {(r["order"], r["seed"]): r for r in runs if r["method"] == "finetune"}
    out = []
    for method in dict.fromkeys(r["method"] for r in runs if r["method"] != "finetune"):
        mine = [r for r in runs if r["method"] == method and (r["order"], r["seed"]) in base]
        if not mine:
            continue
        paired = [base[(r["order"], r["seed"])] for r in mine]
        out.append(paired_verdict(f"{method} forgets less than finetune (forgetting)",
                                  [b["forgetting"] for b in paired], [r["forgetting"] for r in mine]))
        out.append(paired_verdict(f"{method} ends higher than finetune (final avg)",
                                  [r["final_average"] for r in mine], [b["final_average"] for b in paired]))
        out.append(paired_verdict(f"{method} keeps the control better than finetune (Flickr8k-en test R_mean)",
                                  [r["control_last"] for r in mine], [b["control_last"] for b in paired]))
    return out


def cell(row: dict, key: str, digits: int) -> str:
    std = row[key + "_std"]
    if math.isnan(row[key]):
        return "-"
    return f"{row[key]:.{digits}f}" + (f" ± {std:.{digits}f}" if std else "")


def command(args, stream_name: str) -> str:
    tasks = f" --tasks {','.join(args.tasks)}" if args.tasks else ""
    return (f"python benchmarks/forgetting.py --stream {stream_name} --methods {args.methods} "
            f"--train-per-task {args.train_per_task} --eval-per-task {args.eval_per_task} --epochs {args.epochs} "
            f"--first-epochs {args.first_epochs} --batch-size {args.batch_size} --lr {args.lr} --size {args.size} "
            f"--order {','.join(args.order)}{tasks} --seeds {','.join(map(str, args.seeds))}")


def write_tables(runs: list[dict], stream, orders: dict, args, prefix: Path) -> list[dict]:
    rows = aggregate(runs)
    baselines = [eval_baseline(task) for task in stream]
    order_text = "; ".join(f"{name} (seed {seed}): {', '.join(tasks)}" for (name, seed), tasks in orders.items())
    lines = [
        f"# Forgetting benchmark: `{stream.name}`",
        "",
        f"Command: `{command(args, stream.name)}`  ",
        (f"Model: the cached starting model of `benchmarks/pretrain_start.py` ({args.start_model}; see "
         f"`start_model.md`), {args.epochs} epochs on every task" if args.size == "start" else
         f"Model: random CLIP {SIZES[args.size]} (`--size {args.size}`) with the real CLIP vocabulary, pretrained on "
         f"the first task of each order for {args.first_epochs} epochs; {args.epochs} epochs on each later task")
        + f"; lr {args.lr:g}; replay buffers {args.buffer_size} pairs; control = Flickr8k-en test retrieval R_mean "
        f"on {args.control_examples} images after the last task (the starting model: {args.control_start:.1f}). "
        f"Orders: {order_text}. Headline metric per task: R_mean for captioned tasks, "
        "zero-shot accuracy for class tasks (%). R@1 = mean of i2t and t2i Recall@1 (%), captioned tasks only. "
        f"Mean ± standard deviation over {len({tuple(r) for r in rows[0]['runs']})} runs (orders x seeds; model init, "
        "data order and caption sampling change with the seed; every run evaluates on the same eval rows); "
        "plasticity = mean headline score on each task right after training it; first task = the first task "
        "trained (it differs between orders); step-time ratios are taken against `finetune` of the same run.",
        "",
        "| method | final avg (headline) | final avg R@1 | BWT | forgetting | plasticity | first task: after it -> at "
        "the end | control | step time vs finetune | Mod-X rows kept | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (10 + len(RUN_COST_HEADER)) + "|",
    ]
    for r in rows:
        kept = "" if r["modx_kept_fraction"] is None else f"{100 * r['modx_kept_fraction']:.0f}%"
        lines.append(
            f"| {r['method']} | {cell(r, 'final_average', 1)} | {cell(r, 'final_average_R@1', 2)} | "
            f"{cell(r, 'backward_transfer', 1)} | {cell(r, 'forgetting', 1)} | {cell(r, 'plasticity', 1)} | "
            f"{r['first_task_initial']:.1f} -> {r['first_task_final']:.1f} | {cell(r, 'control_last', 1)} | "
            f"{r['step_ratio']:.2f} | {kept} | "
            f"{run_cost_cells(r['cost'])} |"
        )
    lines += ["", RUN_COST_NOTE, "", "Final headline score per task after the last task (mean over runs):", ""]
    lines += score_table("method", {r["method"]: r["final_per_task"] for r in rows}, baselines)
    lines += ["", BASELINE_NOTE, "", "Claims, each method against finetune of the same order and seed:", ""]
    lines += verdict_table(verdicts(runs)) + ["", VERDICT_NOTE]
    results_path(prefix, ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    results_path(prefix, ".json").write_text(
        json.dumps({"summary": rows, "runs": runs, "orders": [[n, s, t] for (n, s), t in orders.items()],
                    "baselines": [vars(b) for b in baselines]}, indent=2) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return rows


def plot(rows: list[dict], stream, prefix: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    for r in rows:
        curve = r["first_task_curve"]
        axes.plot(range(1, len(curve) + 1), curve, marker="o", label=r["method"])
    axes.set_xlabel("after task")
    axes.set_ylabel("first trained task, headline (%)")
    axes.set_title(f"First task's score over the stream ({stream.name}, mean over runs)")
    axes.legend(fontsize=7, ncols=2)
    figure.savefig(results_path(prefix, ".png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stream", default="flickr8k-random5")
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--train-per-task", type=int, default=500)
    parser.add_argument("--eval-per-task", type=int, default=200)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--first-epochs", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--buffer-size", type=int, default=100)
    parser.add_argument("--size", default="default", choices=[*sorted(SIZES), "start"],
                        help="a random CLIP pretrained on the first task, or 'start': the cached starting model of "
                             "benchmarks/pretrain_start.py, every task trained --epochs")
    parser.add_argument("--control-examples", type=int, default=300,
                        help="Flickr8k-en test images of the control column")
    parser.add_argument("--start-model", type=json.loads, default=MODEL, help="the starting model's sizes (JSON)")
    parser.add_argument("--start-epochs", type=float, default=RECIPE["epochs"])
    parser.add_argument("--start-cache", type=Path, default=DEFAULT_CACHE)
    add_stream_arguments(
        parser, default_output=str(RESULTS / "forgetting_{stream}"), orders=("I", "random"),
        tasks_help="comma-separated task names of --stream (e.g. flickr8k,rsscn7 for domains5), trained in the order "
                   "given (default: all, in the stream's order I)",
    )
    args = parser.parse_args()
    prefix = Path(str(args.output).replace("{stream}", args.stream))

    try:
        stream = build_stream(args.stream, max_train_per_task=args.train_per_task,
                              max_eval_per_task=args.eval_per_task)
        reorder(stream, args.tasks or stream.task_names)  # unknown or repeated task names, before any run
    except ValueError as error:
        parser.error(str(error))
    fixed = {"I": stream.task_names}
    tokenizer = load_tokenizer()
    args.control = control_task(args)
    if args.size == "start":
        args.start = load_start_model(ensure_start_model(args.start_model, {**RECIPE, "epochs": args.start_epochs},
                                                         args.start_cache))
    reference = starting_model(args, args.seeds[0])
    args.control_start = evaluate_task(reference, args.control, load_image_processor(
        reference.config.vision_config.image_size), tokenizer)["R_mean"]
    runs, orders = [], {}
    for seed in args.seeds:
        for order, tasks in task_orders(args.order, fixed, args.tasks, seed).items():
            orders[(order, seed)] = tasks
            ordered = reorder(stream, tasks)
            for spec in args.methods.split(","):
                started = time.perf_counter()
                runs.append(run_method(spec, order, seed, ordered, tokenizer, args))
                gc.collect()  # the next run's peak memory should not include this one's learner
                print(f"{spec} order {order} seed {seed}: done in {time.perf_counter() - started:.0f} s", flush=True)
                rows = write_tables(runs, stream, orders, args, prefix)
    plot(rows, stream, prefix)


if __name__ == "__main__":
    main()
