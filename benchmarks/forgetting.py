"""Do the methods keep what was learned? Every method on the same stream, same model init, same epochs per task.

A random CLIP is pretrained on the first task (`--first-epochs`), then trained on the rest of the stream with each
method. Per method: the final average of the headline metric and of Recall@1 (mean of both directions, retrieval
tasks), backward transfer and forgetting (on the headline metric), the first task's Recall@1 after the last task,
Mod-X's kept-row fraction, and the median step time relative to `finetune` from the same run. Plots: the first
task's Recall@1 after every task, one curve per method.

    python benchmarks/forgetting.py --stream flickr8k-random5 [--methods finetune,modx,...] [--seeds 0,1,2]

Writes benchmarks/results/forgetting_<stream>.md/.json/.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
from transformers import TrainerCallback

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip

METHODS = "finetune,joint,modx,ctp,lwf,ewc,si,mas,er,derpp,modx+er,ctp+er"
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


def method_args(names: list[str], buffer_size: int) -> dict:
    args = {}
    for name in names:
        if name in ("er", "der", "derpp"):
            args[name] = {"buffer_size": buffer_size}
        if name == "ctp":
            args[name] = {"queue_size": 256}
    return args


def run_method(spec: str, seed: int, stream, tokenizer, args, output_dir: Path) -> dict:
    names = spec.split("+")
    log = StepLog()
    learner = ContinualLearner(
        tiny_clip(seed=seed, **SIZES[args.size]), stream, build_methods(names, method_args(names, args.buffer_size)),
        load_image_processor(SIZES[args.size]["image_size"]), tokenizer,
        ContinualArguments(
            output_dir=str(output_dir / f"{spec}-seed{seed}"), save_checkpoints=False, progress=False, seed=seed,
            first_task_epochs=args.first_epochs,
            training={"num_train_epochs": args.epochs, "per_device_train_batch_size": args.batch_size,
                      "learning_rate": args.lr, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                      "weight_decay": 0.0},
        ),
        callbacks=[log],
    )
    results = learner.fit()
    task_names = stream.task_names
    r1 = np.array([[recall_at_1(row.metrics[name]) for name in task_names] for row in results.rows])
    summary = results.summary()
    return {
        "method": spec,
        "seed": seed,
        "headline": results.headline().tolist(),
        "recall_at_1": r1.tolist(),
        "final_average": summary["final_average"],
        "final_average_R@1": float(np.nanmean(r1[-1])) if not np.all(np.isnan(r1[-1])) else math.nan,
        "backward_transfer": summary["backward_transfer"],
        "forgetting": summary["forgetting"],
        "first_task_R@1_initial": float(r1[0, 0]),
        "first_task_R@1_final": float(r1[-1, 0]),
        "median_step_s": statistics.median(log.step_times) if log.step_times else math.nan,
        "modx_kept_fraction": statistics.mean(log.kept) if log.kept else None,
        "cost": run_cost(learner.compute),
    }


SCALARS = ("final_average", "final_average_R@1", "backward_transfer", "forgetting", "first_task_R@1_initial",
           "first_task_R@1_final", "step_ratio")


def aggregate(runs: list[dict]) -> list[dict]:
    """Mean and standard deviation over seeds per method; step times as ratios to `finetune` of the same seed."""
    base = {r["seed"]: r["median_step_s"] for r in runs if r["method"] == "finetune"}
    for r in runs:
        r["step_ratio"] = r["median_step_s"] / base.get(r["seed"], math.nan)
    rows = []
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        row = {"method": method, "seeds": [r["seed"] for r in mine]}
        for key in SCALARS:
            values = np.array([r[key] for r in mine], dtype=float)
            row[key] = float(np.mean(values))
            row[key + "_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        kept = [r["modx_kept_fraction"] for r in mine if r["modx_kept_fraction"] is not None]
        row["modx_kept_fraction"] = statistics.fmean(kept) if kept else None
        row["cost"] = mean_run_cost([r["cost"] for r in mine])
        row["first_task_R@1_curve"] = np.mean([[x[0] for x in r["recall_at_1"]] for r in mine], axis=0).tolist()
        rows.append(row)
    return rows


def cell(row: dict, key: str, digits: int) -> str:
    std = row[key + "_std"]
    return f"{row[key]:.{digits}f}" + (f" ± {std:.{digits}f}" if std else "")


def write_tables(runs: list[dict], stream, args, path: Path) -> list[dict]:
    rows = aggregate(runs)
    lines = [
        f"# Forgetting benchmark: `{stream.name}`",
        "",
        f"Command: `python benchmarks/forgetting.py --stream {stream.name} --methods {args.methods} "
        f"--train-per-task {args.train_per_task} --eval-per-task {args.eval_per_task} --epochs {args.epochs} "
        f"--first-epochs {args.first_epochs} --batch-size {args.batch_size} --size {args.size} --seeds {args.seeds}`  ",
        f"Model: random CLIP {SIZES[args.size]} (`--size {args.size}`) with the real CLIP vocabulary, pretrained on "
        "the first task for "
        f"{args.first_epochs} epochs; {args.epochs} epochs on each later task; replay buffers {args.buffer_size} "
        f"pairs. Tasks: {', '.join(stream.task_names)}. Headline metric per task: R_mean for captioned tasks, "
        "zero-shot accuracy for class tasks (%). R@1 = mean of i2t and t2i Recall@1 (%), captioned tasks only. "
        f"Mean ± standard deviation over seeds {args.seeds} (model init, data order and caption sampling change with "
        "the seed); step-time ratios are taken against `finetune` of the same seed.",
        "",
        "| method | final avg (headline) | final avg R@1 | BWT | forgetting | first task R@1: after it -> at the end "
        "| step time vs finetune | Mod-X rows kept | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (8 + len(RUN_COST_HEADER)) + "|",
    ]
    for r in rows:
        kept = "" if r["modx_kept_fraction"] is None else f"{100 * r['modx_kept_fraction']:.0f}%"
        lines.append(
            f"| {r['method']} | {cell(r, 'final_average', 1)} | {cell(r, 'final_average_R@1', 2)} | "
            f"{cell(r, 'backward_transfer', 1)} | {cell(r, 'forgetting', 1)} | {r['first_task_R@1_initial']:.2f} -> "
            f"{r['first_task_R@1_final']:.2f} | {r['step_ratio']:.2f} | {kept} | {run_cost_cells(r['cost'])} |"
        )
    lines += ["", RUN_COST_NOTE]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps({"summary": rows, "runs": runs}, indent=2) + "\n",
                                         encoding="utf-8")
    print("\n".join(lines), flush=True)
    return rows


def plot(rows: list[dict], stream, path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    for r in rows:
        curve = r["first_task_R@1_curve"]
        axes.plot(range(1, len(curve) + 1), curve, marker="o", label=r["method"])
    axes.set_xlabel("after task")
    axes.set_ylabel(f"R@1 on {stream.task_names[0]} (%)")
    axes.set_title(f"First task's Recall@1 over the stream ({stream.name})")
    axes.legend(fontsize=7, ncols=2)
    figure.savefig(path.with_suffix(".png"), dpi=120)


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
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; the table shows mean ± std")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    stream = build_stream(args.stream, max_train_per_task=args.train_per_task, max_eval_per_task=args.eval_per_task)
    tokenizer = load_tokenizer()
    path = Path(args.output) / f"forgetting_{args.stream}"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for spec in args.methods.split(","):
            started = time.perf_counter()
            runs.append(run_method(spec, seed, stream, tokenizer, args, Path("/tmp/hf_ccl_forgetting") / args.stream))
            gc.collect()  # the next run's peak memory should not include this one's learner
            print(f"{spec} seed {seed}: done in {time.perf_counter() - started:.0f} s", flush=True)
            rows = write_tables(runs, stream, args, path)
    plot(rows, stream, path)


if __name__ == "__main__":
    main()
