"""CMCL benchmark: a stream of modality pairs on frozen CLIP towers, learner heads only (issue 7; spec cmcl.md §8).

The prior: a random CLIP {MODEL} trained (all weights) on Flickr8k train images that no task uses, with their
English and German captions mixed (`--prior-images`, `--prior-epochs`), then frozen; its features are cached.
Every run goes through `ContinualLearner` with `learner_heads` and the method (the one loop; before issue 13 it
had its own `PairStreamLearner`). The stream (`hf_ccl.data.pair_streams.flickr_fashion_pairs`): image–en, en–de, image–de (Flickr8k, disjoint images),
image–en on Fashion product titles; `--train-per-task` pairs each, `--test-per-task` test pairs each.

Per method and seed: R@1 (mean of both directions, dot-product scores as in the paper) on every task after every
task; BWT = mean over t < T of R_{t;T} − R_{t;t} (Eq. 14); plasticity = mean of the diagonal R_{t;t}; the drift
‖A_{i;T} − A_{i;i}‖_F / ‖A_{i;i}‖_F of each earlier task's train alignment matrix; time per optimizer step relative
to vanilla (same seed, same machine, one after the other), and the methods' per-task work outside the steps (DNS's
covariances and eigendecompositions, GEM's memories, EWC's Fisher).

Orders: `I` (the stream's own) and `random` (a permutation per seed); `--tasks` picks and orders the pair tasks
(each keeps its pairs). Each per-task score stands beside its binomial standard error, and each method's BWT and
final R@1 are judged against vanilla's from runs paired by (order, seed) (`protocol.py`).

    python benchmarks/cmcl_pairs.py [--order I,random] [--tasks ...] [--seeds 0,1,2,3,4] [--output PREFIX]
        [--runs-dir DIR] [--prior-cache DIR]
    # ~20 min per order on 2 CPU cores (the prior: 4 min; pass --prior-cache DIR to train it once and reuse it)

Writes <output>.md/.json (default benchmarks/results/cmcl_pairs).
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
from protocol import (
    BASELINE_NOTE,
    VERDICT_NOTE,
    add_stream_arguments,
    eval_baseline,
    paired_verdict,
    reorder,
    results_path,
    score_table,
    task_orders,
    verdict_table,
)

from hf_ccl.callbacks import TaskCallback
from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import load_image_processor, load_tokenizer
from hf_ccl.data.builders import load_split, to_canonical
from hf_ccl.data.named import bundled
from hf_ccl.data.pair_streams import flickr_fashion_pairs, flickr_reserved_rows
from hf_ccl.data.task import Task, TaskStream
from hf_ccl.evaluation.continual_metrics import backward_transfer, final_average
from hf_ccl.methods import build_methods
from hf_ccl.pair_features import encode_pair_stream, pair_encoders
from hf_ccl.paths import data_root
from hf_ccl.testing import tiny_clip

MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64, "image_size": 32}
CONFIGS: dict[str, tuple[list[str], dict]] = {
    "vanilla": (["finetune"], {}),
    "dns": (["dns"], {}),
    "dns-one-sided": (["dns"], {"dns": {"variant": "one_sided"}}),
    "dns-official": (["dns"], {"dns": {"preset": "official"}}),
    "dns-update": (["dns"], {"dns": {"project": "update"}}),
    "dns-update-strict": (
        ["dns"],
        {"dns": {"project": "update", "threshold_in": 1e-6, "threshold_out": 1e-6}},
    ),
    "gem": (["gem"], {}),
    "agem": (["agem"], {}),
    "ewc": (["ewc"], {"ewc": {"ewc_lambda": 0.5}}),  # CMCL §4's λ (hf_ccl's CLIP default is the CTP code's 5000)
    "derpp": (["derpp"], {}),
}
RESULTS = Path(__file__).parent / "results"
PRIOR_OPTIONS = "prior_options.json"  # beside a cached prior: what it was trained with


def train_prior(options, tokenizer, image_processor) -> torch.nn.Module:
    """All weights of a random CLIP on reserved Flickr8k images (English + German captions), then frozen."""
    root = data_root()
    flickr = bundled(root, "flickr8k")
    train = load_split(flickr, "train")
    rows = flickr_reserved_rows(root, options.prior_images).tolist()
    subset = train.select(rows)
    mixed = subset.add_column(
        "mixed", [list(en) + list(de) for en, de in zip(subset["en"], subset["de"], strict=True)]
    )
    validation = load_split(flickr, "validation").select(range(200))
    task = Task(
        name="prior",
        train=to_canonical(mixed, source="flickr8k", split="train", text_column="mixed"),
        eval=to_canonical(validation, source="flickr8k", split="validation", text_column="en"),
    )
    learner = ContinualLearner(
        tiny_clip(seed=0, **MODEL),
        TaskStream(name="prior", tasks=[task]),
        build_methods(["finetune"]),
        image_processor,
        tokenizer,
        ContinualArguments(
            output_dir=str(options.runs_dir / "prior"),
            save_checkpoints=False,
            progress=False,
            seed=0,
            evaluation={"initial": False},
            training={
                "num_train_epochs": options.prior_epochs,
                "per_device_train_batch_size": 64,
                "learning_rate": 1e-3,
                "warmup_steps": 0.1,
                "lr_scheduler_type": "cosine",
                "weight_decay": 0.0,  # as the committed table ran (before the defaults applied to Python)
            },
        ),
    )
    results = learner.fit()
    print(
        f"prior: validation R@1 i2t {results.rows[-1].metrics['prior']['i2t_R@1']:.1f} "
        f"t2i {results.rows[-1].metrics['prior']['t2i_R@1']:.1f} (200 images)",
        flush=True,
    )
    return learner.model.eval().requires_grad_(False)


class Timings(TaskCallback):
    """Per task: training time and optimizer steps (the Trainer's), and the methods' task-end work (the time
    between the task's evaluation and its end event, where only the methods' `on_task_end` runs)."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []
        self._evaluated = 0.0

    def on_task_trained(self, args, state, control, **kwargs):  # noqa: ANN001 (task callback protocol)
        trainer = kwargs["trainer"]
        seconds = next(log["train_runtime"] for log in trainer.state.log_history if "train_runtime" in log)
        steps = max(trainer.state.global_step, 1)
        self.records.append({"train_seconds": seconds, "steps": steps, "seconds_per_step": seconds / steps})

    def on_task_evaluated(self, args, state, control, **kwargs):  # noqa: ANN001
        self._evaluated = time.perf_counter()

    def on_task_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.records[-1]["method_task_seconds"] = time.perf_counter() - self._evaluated


def run(label: str, prior, stream, options, order: str, seed: int) -> dict:
    """One method on the (already encoded) stream, from the frozen prior."""
    names, method_args = CONFIGS[label]
    args = ContinualArguments(
        output_dir=str(options.runs_dir / f"{label}-{order}-{seed}"),
        training={"learning_rate": options.lr, "weight_decay": 1e-3, "per_device_train_batch_size": 64,
                  "num_train_epochs": options.epochs, "max_grad_norm": 1.0, "lr_scheduler_type": "linear",
                  "warmup_steps": 0, "dataloader_drop_last": True, "logging_steps": 1000},
        seed=seed, overwrite_output_dir=True, progress=False,
    )
    timings = Timings()
    learner = ContinualLearner(
        copy.deepcopy(prior), stream, build_methods(["learner_heads", *names], method_args),
        load_image_processor(MODEL["image_size"]), load_tokenizer(), args, task_callbacks=[timings],
    )
    started = time.perf_counter()
    matrix = learner.fit()
    wall = time.perf_counter() - started
    records = timings.records
    rows = list(matrix.rows)
    r1 = np.array([[row.metrics[t]["R@1"] for t in stream.task_names] for row in rows])
    cos = np.array(
        [[row.metrics[t].get("cos_R@1", row.metrics[t]["R@1"]) for t in stream.task_names] for row in rows]
    )
    r10 = np.array([[row.metrics[t]["R@10"] for t in stream.task_names] for row in rows])
    drift = [rows[-1].metrics[t].get("drift", float("nan")) for t in stream.task_names[:-1]]
    return {
        "config": label,
        "order": order,
        "seed": seed,
        "tasks": stream.task_names,
        "r1": r1.tolist(),
        "cos_r1": cos.tolist(),
        "initial": [matrix.initial.metrics[t]["R@1"] for t in stream.task_names],
        "bwt": backward_transfer(r1),
        "final": final_average(r1),
        "plasticity": float(np.mean(np.diag(r1))),
        "bwt_cos": backward_transfer(cos),
        "bwt_r10": backward_transfer(r10),
        "final_r10": final_average(r10),
        "drift": drift,
        "mean_drift": float(np.nanmean(drift)),
        "step_s": statistics.median(t["seconds_per_step"] for t in records),
        "train_s": sum(t["train_seconds"] for t in records),
        "method_task_s": sum(t["method_task_seconds"] for t in records),
        "wall_s": wall,
        "cost": run_cost(learner.compute),
    }


def verdicts(results: list[dict], labels: list[str]) -> list:
    """Each method against vanilla of the same order and seed: higher BWT (less forgetting), higher final R@1."""
    base = {(r["order"], r["seed"]): r for r in results if r["config"] == "vanilla"}
    out = []
    for label in labels:
        mine = [r for r in results if r["config"] == label and (r["order"], r["seed"]) in base]
        if label == "vanilla" or not mine:
            continue
        for key, what in (("bwt", "BWT"), ("final", "final R@1")):
            out.append(paired_verdict(f"{label}: {what} above vanilla", [r[key] for r in mine],
                                      [base[(r["order"], r["seed"])][key] for r in mine]))
    return out


def summarize(results: list[dict], labels: list[str], stream, options, prior_note: str) -> str:
    def stats(label: str, key: str) -> tuple[float, float]:
        values = [r[key] for r in results if r["config"] == label]
        return float(np.mean(values)), float(np.std(values))

    step_ratio = {}
    for label in labels:
        ratios = []
        for r in results:
            if r["config"] != label:
                continue
            base = next(b for b in results
                        if b["config"] == "vanilla" and (b["order"], b["seed"]) == (r["order"], r["seed"]))
            ratios.append(r["train_s"] / base["train_s"])
        step_ratio[label] = (float(np.mean(ratios)), float(np.std(ratios)))
    seeds = sorted({r["seed"] for r in results})
    orders = list(dict.fromkeys(r["order"] for r in results))
    order_text = "; ".join(f"{order}: {', '.join(next(r['tasks'] for r in results if r['order'] == order))}"
                           + (" (seed 0's; one per seed)" if order == "random" else "") for order in orders)
    tasks = f"--tasks {','.join(options.tasks)} " if options.tasks else ""
    lines = [
        "# CMCL: modality-pair stream on frozen CLIP towers (learner heads only)",
        "",
        f"Command: `python benchmarks/cmcl_pairs.py --order {','.join(orders)} {tasks}"
        f"--seeds {','.join(map(str, seeds))} --train-per-task "
        f"{options.train_per_task} --test-per-task {options.test_per_task} --epochs {options.epochs} --lr {options.lr} "
        f"--prior-images {options.prior_images} --prior-epochs {options.prior_epochs} "
        f"--timing-repeats {options.timing_repeats}`  ",
        f"{prior_note}  ",
        f"Tasks: {', '.join(f'{t.name} ({t.modalities[0]}–{t.modalities[1]})' for t in stream)}; orders: {order_text}; "
        f"{options.train_per_task} train / {options.test_per_task} test pairs each; AdamW lr {options.lr}, wd 1e-3, "
        f"batch 64, {options.epochs} epochs per task, τ = 1/exp(logit_scale) of the prior, one-directional Eq. 2. "
        f"Mean ± std over runs (orders x seeds {seeds}; a seed changes the task samples and the heads' training).",
        "",
        "R@1 = mean of a→b and b→a Recall@1 (%) with the paper's dot-product scores; BWT (Eq. 14) on R@1; plasticity = "
        "mean R_{t;t}; drift = ‖A_{i;T} − A_{i;i}‖_F/‖A_{i;i}‖_F of each earlier task's train alignment matrix, mean "
        "over tasks; time = training time (all optimizer steps of all tasks, the fastest of the interleaved repeats) relative to "
        "vanilla on the same order and seed; "
        "task-end work = the methods' per-task work outside the steps (s, all tasks).",
        "",
        "| method | final R@1 | BWT | plasticity | BWT (cosine, as a folded CLIP scores) | final R@10 | BWT_R10 "
        "| drift | time vs vanilla | task-end work (s) | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (10 + len(RUN_COST_HEADER)) + "|",
    ]
    for label in labels:
        cells = [
            f"{m:.2f} ± {s:.2f}"
            for m, s in (
                stats(label, k) for k in ("final", "bwt", "plasticity", "bwt_cos", "final_r10", "bwt_r10")
            )
        ]
        drift = stats(label, "mean_drift")
        ratio = step_ratio[label]
        work = stats(label, "method_task_s")
        lines.append(
            f"| {label} | {' | '.join(cells)} | {drift[0]:.4f} | {ratio[0]:.2f} ± {ratio[1]:.2f} "
            f"| {work[0]:.3f} | {run_cost_cells(mean_run_cost([r['cost'] for r in results if r['config'] == label]))} |"
        )
    lines += ["", RUN_COST_NOTE, "", "Claims, each method against vanilla of the same order and seed:", ""]
    lines += verdict_table(verdicts(results, labels)) + ["", VERDICT_NOTE]
    lines += ["", "Per-task R@1 after each task (rows: after training task t; mean over seeds), per order:", ""]
    baselines = [eval_baseline(task) for task in stream]
    first = next(r for r in results)
    initial = dict(zip(first["tasks"], first["initial"], strict=True))
    lines += score_table("initial (the frozen prior)", {"R@1": initial}, baselines)
    for label in labels:
        for order in orders:
            mine = [r for r in results if r["config"] == label and r["order"] == order]
            if not mine:
                continue
            lines += ["", f"**{label}**, order {order}", ""]
            if order == "random":  # the random order differs per seed: one matrix per seed
                for r in mine:
                    rows = {n: dict(zip(r["tasks"], row, strict=True)) for n, row in zip(r["tasks"], r["r1"],
                                                                                         strict=True)}
                    lines += [f"seed {r['seed']}:", ""] + score_table("after \\ eval", rows, baselines) + [""]
                continue
            names, matrix = mine[0]["tasks"], np.mean([r["r1"] for r in mine], axis=0)
            rows = {n: dict(zip(names, row, strict=True)) for n, row in zip(names, matrix, strict=True)}
            lines += score_table("after \\ eval", rows, baselines)
    lines += ["", BASELINE_NOTE]
    return "\n".join(lines) + "\n"


def load_prior(options, tokenizer, image_processor) -> torch.nn.Module:
    """The frozen prior: from `--prior-cache` when it holds one trained with these options, else trained (and
    saved there with the options). A cache trained with other options is a ValueError."""
    from hf_ccl.modeling import ContinualCLIPModel

    wanted = {"model": MODEL, "prior_images": options.prior_images, "prior_epochs": options.prior_epochs}
    cache = Path(options.prior_cache) if options.prior_cache else options.runs_dir / "prior-model"
    if (cache / "config.json").exists():
        recorded = json.loads((cache / PRIOR_OPTIONS).read_text(encoding="utf-8")) if (
            cache / PRIOR_OPTIONS).exists() else None
        if recorded != json.loads(json.dumps(wanted)):
            raise ValueError(f"--prior-cache {cache} holds a prior trained with {recorded}, not {wanted}: give "
                             "another --prior-cache folder or the options it was trained with")
        print(f"prior loaded from {cache}", flush=True)
        return ContinualCLIPModel.from_pretrained(cache).eval().requires_grad_(False)
    prior = train_prior(options, tokenizer, image_processor)
    prior.save_pretrained(cache)
    (cache / PRIOR_OPTIONS).write_text(json.dumps(wanted) + "\n", encoding="utf-8")
    return prior


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--train-per-task", type=int, default=1000)
    parser.add_argument("--test-per-task", type=int, default=200)
    parser.add_argument("--epochs", type=float, default=5.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prior-images", type=int, default=2500)
    parser.add_argument("--prior-epochs", type=float, default=40.0)
    parser.add_argument("--prior-cache", default=None,
                        help="folder of the trained prior, reused by later invocations with the same prior options "
                             "(default: <runs-dir>/prior-model, trained anew)")
    parser.add_argument("--timing-repeats", type=int, default=3)
    parser.add_argument("--summarize-only", action="store_true", help="Rewrite the .md from the saved .json.")
    add_stream_arguments(
        parser, default_output=str(RESULTS / "cmcl_pairs"), orders=("I", "random"), default_seeds="0,1,2,3,4",
        tasks_help="comma-separated pair tasks (flickr-image-en, flickr-en-de, flickr-image-de, fashion-image-en), "
                   "trained in the order given; each keeps its pairs (default: all, in that order I)",
    )
    options = parser.parse_args()
    labels = [label.strip() for label in options.configs.split(",") if label.strip()]
    unknown = [label for label in labels if label not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; valid: {list(CONFIGS)}")
    if "vanilla" not in labels:
        labels.insert(0, "vanilla")

    def pair_stream(seed: int):  # noqa: ANN202
        return flickr_fashion_pairs(data_root(), train_per_task=options.train_per_task,
                                    test_per_task=options.test_per_task, reserve_train_images=options.prior_images,
                                    seed=seed)

    prior_note = (
        f"Prior: random CLIP {MODEL} trained on {options.prior_images} reserved Flickr8k train images "
        f"(en + de captions) for {options.prior_epochs} epochs, then frozen."
    )
    if options.summarize_only:
        results = json.loads(results_path(options.output, ".json").read_text(encoding="utf-8"))
        labels = list(dict.fromkeys(r["config"] for r in results))
        base = pair_stream(0)
        stream = reorder(base, options.tasks or base.task_names)
        for r in results:  # results written before orders: order I, the stream's tasks
            r.setdefault("order", "I")
            r.setdefault("tasks", base.task_names)
        results_path(options.output, ".md").write_text(summarize(results, labels, stream, options, prior_note),
                                                      encoding="utf-8")
        return
    streams = {seed: pair_stream(seed) for seed in options.seeds}
    fixed = {"I": streams[options.seeds[0]].task_names}
    try:
        reorder(streams[options.seeds[0]], options.tasks or fixed["I"])  # unknown or repeated names, before any run
    except ValueError as error:
        parser.error(str(error))
    tokenizer, image_processor = load_tokenizer(), load_image_processor(MODEL["image_size"])
    try:
        prior = load_prior(options, tokenizer, image_processor)
    except ValueError as error:
        parser.error(str(error))
    results = []
    for seed in options.seeds:
        encoders = pair_encoders(copy.deepcopy(prior), image_processor, tokenizer, streams[seed].modalities)
        encoded = encode_pair_stream(streams[seed], encoders)  # once per seed, shared by every method and order
        for order, tasks in task_orders(options.order, fixed, options.tasks, seed).items():
            stream = reorder(encoded, tasks)
            seed_results = {}
            for _repeat in range(options.timing_repeats):  # interleaved repeats; the fastest training time counts
                for label in labels:
                    result = run(label, prior, stream, options, order, seed)
                    if label in seed_results:
                        kept = seed_results[label]
                        kept["train_s"] = min(kept["train_s"], result["train_s"])
                        kept["step_s"] = min(kept["step_s"], result["step_s"])
                        continue
                    seed_results[label] = result
                    print(
                        f"seed {seed} order {order} {label}: final {result['final']:.2f} bwt {result['bwt']:.2f} "
                        f"plasticity {result['plasticity']:.2f} drift {result['mean_drift']:.4f} "
                        f"train {result['train_s']:.2f}s",
                        flush=True,
                    )
            results.extend(seed_results.values())
    results_path(options.output, ".json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    text = summarize(results, labels, reorder(encoded, options.tasks or fixed["I"]), options, prior_note)
    results_path(options.output, ".md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
