"""Keeping zero-shot while learning downstream tasks (ZSCL, MoE-Adapters, WiSE-FT; issue 16) at small scale.

A random CLIP is pretrained on English Flickr8k (all weights, `--pretrain-epochs`): the "zero-shot" model. It then
learns the bundled MTIL-like stream `mtil-bundled` (digits -> CIFAR-10 -> RSSCN7 -> PACS sketch -> Fashion
sub-categories, each its own label space, scored task-aware by zero-shot accuracy with its eval templates), trained
with the image-to-class-prompt cross-entropy (`classification_loss: cross_entropy`, ZSCL Eq. 1). Every method starts
from the same pretrained model:

    finetune       sequential fine-tuning
    lwf            + LwF on the task's own batches (the previous model as teacher)
    wise_ft        weight interpolation with the zero-shot model after each task (alpha 0.8)
    zscl           + distillation from the zero-shot model on reference data (Flickr8k, the pretraining data's
                   domain, as ImageNet + CC are CLIP's) and the weight ensemble
    moe_adapters   mixture-of-experts adapters and routers only (the rest frozen), DDAS selector
    er             + a replay buffer of earlier tasks' examples

Per method (mean ± std over seeds): ZSCL's Transfer / Avg. / Last (ZSCL `mtil/results.ipynb`; `hf_ccl.evaluation.
continual_metrics.mtil_*`), forgetting, the zero-shot model's average, median time per step relative to finetune, the
cost columns (peak memory, trainable parameters, ...). Plots: Transfer/Avg/Last per method, and each method's matrix.

    python benchmarks/mtil.py [--methods finetune,lwf,wise_ft,zscl,moe_adapters,er] [--seeds 0,1]

Writes benchmarks/results/mtil_bundled.md/.json/.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from languages import StepTimes  # benchmarks/ is on the path of `python benchmarks/mtil.py`

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.continual_metrics import (
    forgetting,
    mtil_average,
    mtil_last,
    mtil_per_task,
    mtil_transfer,
)
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64, "image_size": 32}
METHODS = "finetune,lwf,wise_ft,zscl,moe_adapters,er"


def method_args(name: str, options) -> dict:
    return {
        "er": {"er": {"buffer_size": options.buffer_size}},
        "wise_ft": {"wise_ft": {"alpha": options.wise_alpha, "reference": "initial"}},
        "zscl": {"zscl": {"reference_examples": options.reference_examples, "reference_batch_size": options.batch_size,
                          "ensemble_every": options.ensemble_every}},
        "moe_adapters": {"moe_adapters": {"bottleneck": options.moe_bottleneck}},
    }.get(name, {})


def pretrain(options, seed: int, tokenizer) -> torch.nn.Module:
    stream = build_stream("flickr8k-languages", languages=["en"], max_train_per_task=options.pretrain_examples,
                          max_eval_per_task=200)
    learner = ContinualLearner(
        tiny_clip(seed=seed, **MODEL), stream, build_methods(["finetune"]), load_image_processor(MODEL["image_size"]),
        tokenizer,
        ContinualArguments(output_dir=f"/tmp/hf_ccl_mtil/pretrain-{seed}", save_checkpoints=False, progress=False,
                           seed=seed, evaluate_initial=False, overwrite_output_dir=True,
                           training={"num_train_epochs": options.pretrain_epochs, "per_device_train_batch_size": 64,
                                     "learning_rate": 1e-3, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                                     "weight_decay": 0.0}),
    )
    results = learner.fit()
    print(f"Flickr8k pretraining, seed {seed}: {results.rows[-1].metrics['en']}", flush=True)
    return learner.model


def run(name: str, pretrained, stream, options, seed: int) -> dict:
    times = StepTimes()
    learner = ContinualLearner(
        copy.deepcopy(pretrained), stream, build_methods([name], method_args(name, options)),
        load_image_processor(MODEL["image_size"]), load_tokenizer(),
        ContinualArguments(output_dir=f"/tmp/hf_ccl_mtil/{name}-{seed}", save_checkpoints=False, progress=False,
                           seed=seed, overwrite_output_dir=True, classification_loss="cross_entropy",
                           training={"num_train_epochs": options.epochs,
                                     "per_device_train_batch_size": options.batch_size,
                                     "learning_rate": options.moe_lr if name == "moe_adapters" else options.lr,
                                     "weight_decay": 0.1, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                                     "logging_steps": 50}),
        callbacks=[times],
    )
    results = learner.fit()
    R, b = results.headline(), results.initial_headline()
    return {
        "method": name, "seed": seed, "R": R.tolist(), "initial": b.tolist(),
        "transfer": mtil_transfer(R), "average": mtil_average(R), "last": mtil_last(R), "forgetting": forgetting(R),
        "zero_shot": float(np.mean(b)), "zero_shot_transfer": mtil_transfer(np.tile(b, (len(b), 1))),
        "median_step_s": statistics.median(times.times) if times.times else float("nan"),
        "cost": run_cost(learner.compute),
    }


def _mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def write(runs: list[dict], tasks: list[str], options, path: Path) -> None:
    methods = list(dict.fromkeys(r["method"] for r in runs))
    base = {r["seed"]: r["median_step_s"] for r in runs if r["method"] == "finetune"}
    zero = [r for r in runs if r["method"] == methods[0]]
    lines = [
        "# Keeping zero-shot while learning downstream tasks: `mtil-bundled`",
        "",
        f"Command: `python benchmarks/mtil.py --methods {options.methods} --train-per-task {options.train_per_task} "
        f"--eval-per-task {options.eval_per_task} --epochs {options.epochs} --batch-size {options.batch_size} "
        f"--lr {options.lr} --pretrain-examples {options.pretrain_examples} --pretrain-epochs "
        f"{options.pretrain_epochs} --buffer-size {options.buffer_size} --wise-alpha {options.wise_alpha} "
        f"--reference-examples {options.reference_examples} --ensemble-every {options.ensemble_every} "
        f"--moe-bottleneck {options.moe_bottleneck} --moe-lr {options.moe_lr} "
        f"--seeds {options.seeds}`  ",
        f"A random CLIP {MODEL} with the real CLIP vocabulary, pretrained on English Flickr8k "
        f"({options.pretrain_examples} images, {options.pretrain_epochs} epochs): the zero-shot model. Then the tasks "
        f"{' -> '.join(tasks)} ({options.train_per_task} training images each, {options.epochs} epochs, batch "
        f"{options.batch_size}, lr {options.lr}, moe_adapters' lr {options.moe_lr}: its experts start at zero and "
        f"are scaled by 0.1; cosine), with the image-to-class-prompt cross-entropy; each task is "
        f"scored task-aware by zero-shot accuracy (its eval templates) on {options.eval_per_task} eval images. "
        "Transfer / Avg. / Last as ZSCL's `mtil/results.ipynb`: Transfer = per task j >= 1 the mean of its accuracy "
        "at the steps before it is trained, averaged over tasks; Avg. = per task the mean over all steps; Last = the "
        "final row's mean. Zero-shot row: the pretrained model's scores on every row (ZSCL's convention). Mean ± std "
        f"over seeds {options.seeds}; step time relative to finetune of the same seed.",
        "",
        "| method | Transfer | Avg. | Last | forgetting | time/step vs finetune | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (6 + len(RUN_COST_HEADER)) + "|",
        f"| zero-shot model | {_mean_std([r['zero_shot_transfer'] for r in zero])} | "
        f"{_mean_std([r['zero_shot'] for r in zero])} | {_mean_std([r['zero_shot'] for r in zero])} | | |"
        + " |" * len(RUN_COST_HEADER),
    ]
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        ratio = float(np.mean([r["median_step_s"] / base.get(r["seed"], float("nan")) for r in mine]))
        lines.append(
            f"| {method} | {_mean_std([r['transfer'] for r in mine])} | {_mean_std([r['average'] for r in mine])} | "
            f"{_mean_std([r['last'] for r in mine])} | {_mean_std([r['forgetting'] for r in mine])} | {ratio:.2f} | "
            f"{run_cost_cells(mean_run_cost([r['cost'] for r in mine]))} |")
    lines += ["", RUN_COST_NOTE, "", "Per task (seed mean): Transfer / Avg. / Last", "",
              "| method | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for method in methods:
        per_task = [mtil_per_task(np.array(r["R"])) for r in runs if r["method"] == method]
        cells = []
        for j in range(len(tasks)):
            t, a, last = (float(np.mean([p[key][j] for p in per_task])) for key in ("transfer", "average", "last"))
            cells.append(("-" if np.isnan(t) else f"{t:.1f}") + f" / {a:.1f} / {last:.1f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Results matrices (accuracy %, seed mean; rows: the zero-shot model, then after each task):", ""]
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        initial = np.mean([r["initial"] for r in mine], axis=0)
        matrix = np.mean([r["R"] for r in mine], axis=0)
        lines += [f"**{method}**", "", "| after \\ eval | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|",
                  "| zero-shot | " + " | ".join(f"{v:.1f}" for v in initial) + " |"]
        for task, values in zip(tasks, matrix, strict=True):
            lines.append(f"| {task} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
        lines.append("")
    path.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")
    plot(runs, methods, path.with_suffix(".png"))
    print("\n".join(lines[:9 + len(methods)]), flush=True)


def plot(runs: list[dict], methods: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    keys = ("transfer", "average", "last")
    figure, axis = plt.subplots(figsize=(1.6 * len(methods) + 2, 3.5))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        means = [np.mean([r[key] for r in runs if r["method"] == m]) for m in methods]
        stds = [np.std([r[key] for r in runs if r["method"] == m]) for m in methods]
        axis.bar(np.arange(len(methods)) + (k - 1) * width, means, width, yerr=stds, label=key.capitalize())
    zero = [r for r in runs if r["method"] == methods[0]]
    axis.axhline(np.mean([r["zero_shot_transfer"] for r in zero]), color="grey", linestyle="--",
                 label="zero-shot Transfer")
    axis.set_xticks(np.arange(len(methods)), methods)
    axis.set_ylabel("accuracy (%)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--train-per-task", type=int, default=1000)
    parser.add_argument("--eval-per-task", type=int, default=300)
    parser.add_argument("--epochs", type=float, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pretrain-examples", type=int, default=6000)
    parser.add_argument("--pretrain-epochs", type=float, default=10)
    parser.add_argument("--buffer-size", type=int, default=200)
    parser.add_argument("--wise-alpha", type=float, default=0.8)
    parser.add_argument("--reference-examples", type=int, default=2000)
    parser.add_argument("--ensemble-every", type=int, default=10)
    parser.add_argument("--moe-bottleneck", type=int, default=16, help="expert width (ViT-B/16: 64 of 768)")
    parser.add_argument("--moe-lr", type=float, default=2e-2,
                        help="moe_adapters' learning rate (zero-initialised experts scaled by 0.1: the official "
                             "scripts use 1e-3..5e-3 over 1000 iterations per task)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "mtil_bundled"))
    options = parser.parse_args()
    stream = build_stream("mtil-bundled", max_train_per_task=options.train_per_task,
                          max_eval_per_task=options.eval_per_task)
    tokenizer = load_tokenizer()
    runs = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        pretrained = pretrain(options, seed, tokenizer)
        for name in options.methods.split(","):
            started = time.perf_counter()
            runs.append(run(name, pretrained, stream, options, seed))
            print(f"{name} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
            write(runs, stream.task_names, options, Path(options.output))


if __name__ == "__main__":
    main()
