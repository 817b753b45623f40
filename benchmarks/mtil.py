"""Keeping zero-shot while learning downstream tasks (ZSCL, MoE-Adapters, WiSE-FT; issues 16, 26) at small scale.

Every method starts from the same starting model (`benchmarks/pretrain_start.py`: a small CLIP pretrained on
Flickr8k-en, Fashion titles and templated Caltech-101, cached) and learns `mtil-heldout`, five datasets that model
never saw, each its own label space, scored task-aware by zero-shot accuracy (its eval templates) on a stratified
eval subset, with the image-to-class-prompt cross-entropy (`classification_loss: cross_entropy`, ZSCL Eq. 1):

    finetune       sequential fine-tuning
    lwf            + LwF on the task's own batches (the previous model as teacher)
    wise_ft        weight interpolation with the zero-shot model after each task (alpha 0.8)
    zscl           + distillation from the zero-shot model on reference data (Flickr8k, the pretraining domain, as
                   ImageNet + CC are CLIP's) and the weight ensemble
    moe_adapters   mixture-of-experts adapters and routers only (the rest frozen), DDAS selector
    er             + a replay buffer of earlier tasks' examples

Orders: ZSCL's I and II of the MTIL datasets the tasks stand in for, and a random one per seed (`--order`,
`--tasks`). Per run: ZSCL's Transfer / Avg. / Last (`hf_ccl.evaluation.continual_metrics.mtil_*`), Transfer over
the tasks where the starting model is above the majority rate (by 2 SE), plasticity (accuracy right after training
each task) next to forgetting, and the control: the starting model's own ability, Flickr8k English test retrieval
(R_mean on a fixed subset), after the last task. Claims are judged from paired per-(order, seed) differences with a
95% t-interval (`benchmarks/protocol.py`).

    python benchmarks/mtil.py [--methods finetune,lwf,wise_ft,zscl,moe_adapters,er] [--order I,II,random]
                              [--seeds 0,1,2] [--output benchmarks/results/mtil_heldout]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from languages import StepTimes  # benchmarks/ is on the path of `python benchmarks/mtil.py`
from pretrain_start import DEFAULT_CACHE, MODEL, RECIPE, ensure_start_model, load_start_model
from protocol import (
    ControlRetrieval,
    above_majority,
    add_stream_arguments,
    baseline_cells,
    control_task,
    eval_baseline,
    paired_verdict,
    plasticity,
    results_path,
    score_table,
    task_orders,
    transfer_over,
    verdict_table,
)

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.data.named import MTIL_HELDOUT_ORDERS
from hf_ccl.evaluation.continual_metrics import (
    forgetting,
    mtil_average,
    mtil_last,
    mtil_per_task,
    mtil_transfer,
)
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import build_methods

METHODS = "finetune,lwf,wise_ft,zscl,moe_adapters,er"
#: (claim, a, b, metric): "a's metric > b's", paired by (order, seed); forgetting claims compare b - a.
CLAIMS = (
    ("ZSCL keeps Transfer better than fine-tuning", "zscl", "finetune", "transfer"),
    ("ZSCL keeps Transfer (above-majority tasks) better than fine-tuning", "zscl", "finetune", "transfer_above"),
    ("ZSCL's Last is above fine-tuning's", "zscl", "finetune", "last"),
    ("ZSCL keeps the pretraining domain (control) better than fine-tuning", "zscl", "finetune", "control_last"),
    ("MoE-Adapters keeps Transfer better than fine-tuning", "moe_adapters", "finetune", "transfer"),
    ("MoE-Adapters forgets less than fine-tuning", "finetune", "moe_adapters", "forgetting"),
    ("MoE-Adapters learns each task as well as fine-tuning (plasticity)", "moe_adapters", "finetune", "plasticity"),
    ("WiSE-FT keeps Transfer better than fine-tuning", "wise_ft", "finetune", "transfer"),
    ("WiSE-FT's Last is above fine-tuning's", "wise_ft", "finetune", "last"),
    ("LwF keeps Transfer better than fine-tuning", "lwf", "finetune", "transfer"),
    ("ER's Last is above fine-tuning's", "er", "finetune", "last"),
)


def method_args(name: str, options) -> dict:
    return {
        "er": {"er": {"buffer_size": options.buffer_size}},
        "wise_ft": {"wise_ft": {"alpha": options.wise_alpha, "reference": "initial"}},
        "zscl": {"zscl": {"reference_examples": options.reference_examples, "reference_batch_size": options.batch_size,
                          "ensemble_every": options.ensemble_every}},
        "moe_adapters": {"moe_adapters": {"bottleneck": options.moe_bottleneck}},
    }.get(name, {})


def run(name: str, start, stream, order: str, options, seed: int, control: Any, above: list[bool]) -> dict:
    times, kept = StepTimes(), ControlRetrieval(control)
    learner = ContinualLearner(
        copy.deepcopy(start), stream, build_methods([name], method_args(name, options)),
        load_image_processor(start.config.vision_config.image_size), load_tokenizer(),
        ContinualArguments(output_dir=str(Path(options.runs_dir) / f"{name}-{order}-{seed}"), save_checkpoints=False,
                           progress=False, seed=seed, overwrite_output_dir=True, classification_loss="cross_entropy",
                           training={"num_train_epochs": options.epochs,
                                     "per_device_train_batch_size": options.batch_size,
                                     "learning_rate": options.moe_lr if name == "moe_adapters" else options.lr,
                                     "weight_decay": 0.1, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                                     "logging_steps": 50}),
        callbacks=[times], task_callbacks=[kept],
    )
    results = learner.fit()
    R, b = results.headline(), results.initial_headline()
    tasks = stream.task_names
    return {
        "method": name, "seed": seed, "order": order, "tasks": tasks, "R": R.tolist(), "initial": b.tolist(),
        "transfer": mtil_transfer(R), "transfer_above": transfer_over(R, [j for j, a in enumerate(above) if a]),
        "average": mtil_average(R), "last": mtil_last(R), "forgetting": forgetting(R), "plasticity": plasticity(R),
        "control": kept.scores, "control_last": kept.scores[-1],
        "zero_shot": float(np.mean(b)), "zero_shot_transfer": mtil_transfer(np.tile(b, (len(b), 1))),
        "zero_shot_transfer_above": transfer_over(np.tile(b, (len(b), 1)), [j for j, a in enumerate(above) if a]),
        "median_step_s": statistics.median(times.times) if times.times else float("nan"),
        "cost": run_cost(learner.compute),
    }


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if not np.isnan(v)]
    if not values:
        return "-"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def verdicts(runs: list[dict]) -> list:
    found = []
    for claim, a, b, metric in CLAIMS:
        pairs = {(r["order"], r["seed"]): r for r in runs if r["method"] == b}
        mine = [(r, pairs[(r["order"], r["seed"])]) for r in runs if r["method"] == a and (r["order"], r["seed"])
                in pairs]
        if not mine:
            continue
        found.append(paired_verdict(claim, [x[metric] for x, _ in mine], [y[metric] for _, y in mine]))
    return found


def write(runs: list[dict], baselines: list, start: dict, options, command: str, path: Path) -> None:
    methods = list(dict.fromkeys(r["method"] for r in runs))
    base = {(r["order"], r["seed"]): r["median_step_s"] for r in runs if r["method"] == "finetune"}
    zero = [r for r in runs if r["method"] == methods[0]]
    above = [b.task for b, a in zip(baselines, start["above"], strict=True) if a]
    orders = sorted({r["order"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    lines = [
        "# Keeping zero-shot while learning downstream tasks: `mtil-heldout`",
        "",
        f"Command: `{command}`  ",
        f"Starting model: `benchmarks/pretrain_start.py` ({options.start_model}, see `start_model.md`; control Flickr8k-en test "
        f"R_mean {start['control']:.1f} on {options.control_examples} images). Tasks (orders {', '.join(orders)}; "
        f"random = a seeded permutation per seed): {options.train_per_task} training images each, {options.epochs:g} "
        f"epochs, batch {options.batch_size}, lr {options.lr:g} (moe_adapters {options.moe_lr:g}: zero-initialised "
        f"experts scaled by 0.1), cosine, weight decay 0.1, the image-to-class-prompt cross-entropy; each task "
        f"scored task-aware on {options.eval_per_task} stratified eval images. Seeds {', '.join(map(str, seeds))}: "
        f"{len(orders) * len(seeds)} (order, seed) pairs per method.",
        "",
        "Transfer / Avg. / Last as ZSCL's `mtil/results.ipynb` (Transfer = per task j >= 1 the mean of its accuracy "
        "at the steps before it is trained, averaged over tasks; Avg. = per task the mean over all steps; Last = the "
        f"final row's mean). **Transfer (above)**: the same over the tasks where the starting model is above the "
        f"majority rate by 2 SE on the eval subset ({', '.join(above) or 'none'}). **Plasticity**: the mean accuracy "
        "right after training each task; **forgetting**: the mean drop from a task's best to its last accuracy. "
        "**Control**: Flickr8k-en test retrieval R_mean after the last task (the starting model's own domain). "
        "Mean ± std over (order, seed) pairs.",
        "",
        "Eval subsets, and the starting model's zero-shot accuracy on them ± binomial SE beside chance and the "
        "majority rate:",
        "",
        *baseline_cells(baselines),
        "",
        *score_table("model", {"zero-shot model": start["zero_shot"]}, baselines),
        "",
        "| method | Transfer | Transfer (above) | Avg. | Last | plasticity | forgetting | control | time/step vs "
        "finetune | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (9 + len(RUN_COST_HEADER)) + "|",
        f"| zero-shot model | {_mean_std([r['zero_shot_transfer'] for r in zero])} | "
        f"{_mean_std([r['zero_shot_transfer_above'] for r in zero])} | {_mean_std([r['zero_shot'] for r in zero])} | "
        f"{_mean_std([r['zero_shot'] for r in zero])} | | | {start['control']:.1f} | |" + " |" * len(RUN_COST_HEADER),
    ]
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        ratio = float(np.mean([r["median_step_s"] / base.get((r["order"], r["seed"]), float("nan")) for r in mine]))
        lines.append(
            f"| {method} | " + " | ".join(_mean_std([r[key] for r in mine]) for key in (
                "transfer", "transfer_above", "average", "last", "plasticity", "forgetting", "control_last"))
            + f" | {ratio:.2f} | {run_cost_cells(mean_run_cost([r['cost'] for r in mine]))} |")
    lines += ["", RUN_COST_NOTE, "", "Claims, from paired per-(order, seed) differences (a - b; forgetting: b - a), "
              "95% t-interval:", "", *verdict_table(verdicts(runs)), ""]
    names = [b.task for b in baselines]
    finals = {"zero-shot model": start["zero_shot"]}
    for method in methods:
        last = [dict(zip(r["tasks"], r["R"][-1], strict=True)) for r in runs if r["method"] == method]
        finals[method] = {task: float(np.mean([row[task] for row in last])) for task in names}
    lines += ["Accuracy after the last task (mean over pairs; ± the binomial SE of one run's score on the eval rows):",
              "", *score_table("method", finals, baselines), ""]
    lines += ["Per task (mean over pairs): Transfer / Avg. / Last", "",
              "| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for method in methods:
        cells = []
        for task in names:
            values = {"transfer": [], "average": [], "last": []}
            for r in runs:
                if r["method"] != method:
                    continue
                per = mtil_per_task(np.array(r["R"]))
                j = r["tasks"].index(task)
                for key in values:
                    values[key].append(per[key][j])
            t, a, last = (float(np.nanmean(values[k])) if not all(np.isnan(values[k])) else float("nan")
                          for k in ("transfer", "average", "last"))
            cells.append(("-" if np.isnan(t) else f"{t:.1f}") + f" / {a:.1f} / {last:.1f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Results matrices of order I, seed mean (rows: the zero-shot model, then after each task):", ""]
    for method in methods:
        mine = [r for r in runs if r["method"] == method and r["order"] == "I"]
        if not mine:
            continue
        tasks = mine[0]["tasks"]
        initial = np.mean([r["initial"] for r in mine], axis=0)
        matrix = np.mean([r["R"] for r in mine], axis=0)
        lines += [f"**{method}**", "", "| after \\ eval | " + " | ".join(tasks) + " |",
                  "|---" * (len(tasks) + 1) + "|", "| zero-shot | " + " | ".join(f"{v:.1f}" for v in initial) + " |"]
        for task, values in zip(tasks, matrix, strict=True):
            lines.append(f"| {task} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
        lines.append("")
    results_path(path, ".md").write_text("\n".join(lines), encoding="utf-8")
    results_path(path, ".json").write_text(json.dumps({"start": start, "runs": runs}, indent=2) + "\n",
                                         encoding="utf-8")


def summarize(options) -> None:
    """Rewrite the tables from the JSON of an earlier call (same --output), keeping its command line."""
    saved = json.loads(results_path(options.output, ".json").read_text(encoding="utf-8"))
    old = results_path(options.output, ".md").read_text(encoding="utf-8")
    command = old.split("Command: `", 1)[1].split("`", 1)[0]
    names = list(saved["start"]["zero_shot"])
    reference = build_stream("mtil-heldout", tasks=tuple(options.tasks or MTIL_HELDOUT_ORDERS["I"]),
                             max_train_per_task=1, max_eval_per_task=options.eval_per_task)
    baselines = [eval_baseline(task) for task in reference]
    if [b.task for b in baselines] != names:
        raise SystemExit(f"mtil.py: error: --tasks gives {[b.task for b in baselines]}, the runs have {names}")
    write(saved["runs"], baselines, saved["start"], options, command, options.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--train-per-task", type=int, default=500)
    parser.add_argument("--eval-per-task", type=int, default=300)
    parser.add_argument("--control-examples", type=int, default=300)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--buffer-size", type=int, default=200)
    parser.add_argument("--wise-alpha", type=float, default=0.8)
    parser.add_argument("--reference-examples", type=int, default=2000)
    parser.add_argument("--ensemble-every", type=int, default=10)
    parser.add_argument("--moe-bottleneck", type=int, default=16, help="expert width (ViT-B/16: 64 of 768)")
    parser.add_argument("--moe-lr", type=float, default=2e-2,
                        help="moe_adapters' learning rate (zero-initialised experts scaled by 0.1: the official "
                             "scripts use 1e-3..5e-3 over 1000 iterations per task)")
    parser.add_argument("--start-model", type=json.loads, default=MODEL,
                        help="the starting model's sizes (JSON; benchmarks/pretrain_start.py)")
    parser.add_argument("--start-epochs", type=float, default=RECIPE["epochs"],
                        help="the starting model's pretraining epochs")
    parser.add_argument("--start-cache", type=Path, default=DEFAULT_CACHE, help="where starting models are cached")
    parser.add_argument("--summarize-only", action="store_true",
                        help="rewrite <output>.md from <output>.json (the runs of an earlier call) without training")
    add_stream_arguments(parser, default_output=str(Path(__file__).parent / "results" / "mtil_heldout"))
    options = parser.parse_args()
    if options.summarize_only:
        summarize(options)
        return
    command = "python benchmarks/mtil.py " + " ".join(
        f"--{key.replace('_', '-')} " + (",".join(map(str, value)) if isinstance(value, list) else
                                         f"'{json.dumps(value)}'" if isinstance(value, dict) else str(value))
        for key, value in vars(options).items() if key not in ("runs_dir", "start_cache") and value is not None)
    start_model = load_start_model(ensure_start_model(
        options.start_model, {**RECIPE, "epochs": options.start_epochs}, options.start_cache))
    image_size = start_model.config.vision_config.image_size
    tokenizer = load_tokenizer()
    control = control_task(options)
    tasks = options.tasks
    reference = build_stream("mtil-heldout", tasks=tasks or MTIL_HELDOUT_ORDERS["I"],
                             max_train_per_task=1, max_eval_per_task=options.eval_per_task)
    initial = {}
    for task in reference:
        initial[task.name] = evaluate_task(start_model, task, load_image_processor(image_size),
                                           tokenizer)["accuracy"]
    baselines = [eval_baseline(task) for task in reference]
    above_by_name = {b.task: above_majority(initial[b.task], b) for b in baselines}
    start = {"zero_shot": initial, "above": [above_by_name[b.task] for b in baselines],
             "control": evaluate_task(start_model, control, load_image_processor(image_size),
                                      tokenizer)["R_mean"]}
    runs = []
    for seed in options.seeds:
        for order, keys in task_orders(options.order, MTIL_HELDOUT_ORDERS, tasks, seed).items():
            stream = build_stream("mtil-heldout", tasks=tuple(keys), max_train_per_task=options.train_per_task,
                                  max_eval_per_task=options.eval_per_task)
            above = [above_by_name[name] for name in stream.task_names]
            for name in options.methods.split(","):
                started = time.perf_counter()
                torch.manual_seed(seed)
                runs.append(run(name, start_model, stream, order, options, seed, control, above))
                print(f"{name} order {order} seed {seed}: {time.perf_counter() - started:.0f} s; Transfer "
                      f"{runs[-1]['transfer']:.1f}, Last {runs[-1]['last']:.1f}", flush=True)
                write(runs, baselines, start, options, command, options.output)
    print(results_path(options.output, ".md").read_text(encoding="utf-8")[:6000], flush=True)


if __name__ == "__main__":
    main()
