"""One table of every family on the same streams (issue 26, item 4): where to choose a method.

Every method starts from the same starting model (`benchmarks/pretrain_start.py`, cached) and learns the same two
streams with the same budget (`--train-per-task` images per task, `--epochs`, `--batch-size`) and the same seeds,
each task trained with the image-to-class-prompt cross-entropy (`classification_loss: cross_entropy`, ZSCL Eq. 1)
and scored task-aware by zero-shot accuracy (its eval templates) on a stratified eval subset:

    pacs-domains   a domain stream, one label space: PACS photo -> art_painting -> cartoon -> sketch (order I;
                   order II is the reverse), 7 classes, domain templates
    mtil-heldout   a downstream stream, a label space per task: cifar10 -> dtd10 -> pacs-photo -> rsscn7 -> mnist
                   (ZSCL's order I; II as `benchmarks/mtil.py`), datasets the starting model never saw

Methods (`--methods`, default all), by family:

    continual pre-training   finetune, joint; distillation: modx, ctp, lwf, c_clip; regularisation: ewc, si, mas;
                             replay: er, derpp; gradient projection: dns, gem, agem; TiC-CLIP's data strategies:
                             cumulative_all, cumulative_exp, cumulative_equal, restart, oracle, patching;
                             parameter-efficient: lora, prompt
    downstream               zscl, moe_adapters, wise_ft, weight_ensemble, diki, condu
    model merging            magmax

Per method and stream (mean ± std over (order, seed) pairs): Last, Avg. and Transfer as ZSCL's `mtil/results.ipynb`
(on pacs-domains Transfer is the same formula: the accuracy on the domains not trained yet), Transfer over the tasks
where the starting model is above the majority rate, plasticity (accuracy right after training each task), forgetting,
the control (Flickr8k-en test retrieval R_mean after the last task: the starting model's own domain), the median step
time relative to finetune, and the cost columns (`hf_ccl.compute`). Each method is judged against finetune on Last and
on Transfer from paired per-(order, seed) differences (`benchmarks/protocol.py`). A method the library refuses on a
stream is listed with the reason, not dropped.

    python benchmarks/families.py [--methods finetune,...] [--streams pacs-domains,mtil-heldout] [--order I]
                                  [--seeds 0,1] [--output benchmarks/results/families]
    python benchmarks/families.py --smoke --output /tmp/families_smoke      # every method, tiny sizes (minutes)

Writes <output>.md, <output>.json and <output>.png.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from languages import StepTimes  # benchmarks/ is on the path of `python benchmarks/families.py`
from mtil import method_args as mtil_method_args
from pretrain_start import DEFAULT_CACHE, MODEL, RECIPE, ensure_start_model, load_start_model
from protocol import (
    ControlRetrieval,
    TaskBaseline,
    above_majority,
    add_stream_arguments,
    baseline_cells,
    control_task,
    eval_baseline,
    format_score,
    paired_verdict,
    plasticity,
    results_path,
    score_table,
    task_orders,
    transfer_over,
    verdict_table,
)

from hf_ccl.class_prompts import scope_class_names
from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.data.named import MTIL_HELDOUT_ORDERS, MTIL_HELDOUT_TASKS, PACS_DOMAINS
from hf_ccl.evaluation.continual_metrics import forgetting, mtil_average, mtil_last, mtil_transfer
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import build_methods
from hf_ccl.methods.registry import get_method_class
from hf_ccl.testing import TINY_CLIP
from hf_ccl.validation import ConfigError

#: method -> family, in the table's order.
FAMILIES = {
    "finetune": "baseline", "joint": "baseline (all data so far)",
    "modx": "distillation", "ctp": "distillation", "lwf": "distillation",
    "ewc": "regularisation", "si": "regularisation", "mas": "regularisation",
    "er": "replay", "derpp": "replay",
    "dns": "gradient projection", "gem": "gradient projection", "agem": "gradient projection",
    "cumulative_all": "TiC data strategy", "cumulative_exp": "TiC data strategy",
    "cumulative_equal": "TiC data strategy", "restart": "TiC data strategy", "oracle": "TiC data strategy",
    "patching": "TiC data strategy",
    "lora": "parameter-efficient", "prompt": "parameter-efficient",
    "zscl": "downstream", "moe_adapters": "downstream", "wise_ft": "downstream", "weight_ensemble": "downstream",
    "c_clip": "distillation",
    "diki": "downstream", "condu": "downstream",
    "magmax": "model merging",
}
METHODS = ",".join(FAMILIES)
#: Registered methods this table does not compare, and why (a user may still name them in `--methods`).
NOT_COMPARED = {
    "sequential": "the same computation as finetune (TiC-CLIP's name for it)",
    "der": "DER++ (derpp) is compared; DER is its beta = 0 case",
    "cllclip, teir, grow_vocab": "the language family (new vocabulary, token-embedding rows, parallel captions): "
                                 "compared on a language stream in benchmarks/languages.py (cllclip's terms replace "
                                 "the class-prompt cross-entropy)",
    "learner_heads": "CMCL's modality-pair family on frozen features; see benchmarks/cmcl_pairs.py",
    "lada": "its own loss replaces the class-prompt cross-entropy every method here trains with, and it is a "
            "task-agnostic method (class_scope seen/all): compared on the X-TAIL protocol (xtail-bundled) in "
            "benchmarks/xtail.py",
    "rail": "trains nothing (a closed-form regression on the frozen model's features, no optimizer step, so no step "
            "time or budget to compare), and it is a task-agnostic method: compared on the X-TAIL protocol in "
            "benchmarks/xtail.py",
}
#: Why each method is configured as it is (the options themselves are printed from `family_args`).
WHY = {
    "finetune": "sequential fine-tuning, the reference of every verdict",
    "joint": "one pass over every task's data so far (the upper bound, outside the budget: t x C at task t)",
    "modx": "paper settings (alpha 20, positive-mask row selection)",
    "ctp": "queue 4 x the batch (specs/ctp.md §8 at small scale); keeps the starting model's learned temperature",
    "lwf": "LwF defaults (lambda 1, T 2) on the in-batch similarity matrix",
    "ewc": "CTP code's lambda 5000, Fisher of the cross-entropy the task trains with",
    "si": "c 1, xi 0.1 (CTP code)",
    "mas": "lambda 1 (paper), per-example importance",
    "er": "reservoir buffer of `--buffer-size` examples mixed into each task",
    "derpp": "the same buffer, alpha 1, beta 0.5 (mammoth)",
    "dns": "projections on both projection layers, `project: update` (exact under AdamW)",
    "gem": "`--memory-per-task` examples per earlier task (the replay buffer's order of size)",
    "agem": "the same memories, a reference batch of one training batch",
    "cumulative_all": "every old example kept, the pool capped at the current task's size",
    "cumulative_exp": "old steps' shares halve with age, capacity = the current task's size",
    "cumulative_equal": "equal shares of old steps, capacity = the current task's size",
    "restart": "a fresh random init at every step, C samples of all data so far: discards the starting model",
    "oracle": "restart with t x C at step t (TiC's upper bound, outside the budget)",
    "patching": "interpolation with the last patched model, alpha chosen on 10% of each task's train rows",
    "lora": "rank 8, q/k/v/out of both towers, merged after each task, `--lora-lr`",
    "prompt": "CoOp, 4 context vectors initialised from 'a photo of a', one prompt continued over the stream, "
              "`--prompt-lr`",
    "zscl": "Flickr8k as the reference data (the pretraining domain), weight ensemble every ~1/10 task",
    "moe_adapters": "bottleneck `--moe-bottleneck`, DDAS, `--moe-lr` (zero-initialised experts scaled by 0.1)",
    "wise_ft": "interpolation with the zero-shot model after each task (alpha `--wise-alpha`)",
    "weight_ensemble": "ZSCL's weight ensemble alone, every ~1/10 task",
    "diki": "residual attention prompts in the first 8 layers of both towers, likelihood routing and calibration "
            "(the official code's settings), `--diki-lr`",
    "c_clip": "LoRA per task (r 16, out_proj/fc1/fc2 of both towers) folded in at alpha 0.5, CKC weight 1 (paper), "
              "`--c-clip-lr`",
    "condu": "each task from the starting model, task vectors unified (sign election, masks, rescalers), task-aware "
             "experts and semantic voting over the top 4 tasks on unseen ones (official code)",
    "magmax": "sequential fine-tuning, deploy θ_0 + 0.5 x the max-magnitude merge of the task vectors (official λ)",
}
PACS_ORDERS = {"I": PACS_DOMAINS, "II": tuple(reversed(PACS_DOMAINS))}
#: The smoke run's sizes: a tiny starting model pretrained for a few steps, a few images per task.
SMOKE = {"start_model": TINY_CLIP, "start_epochs": 0.02, "train_per_task": 8, "eval_per_task": 16,
         "control_examples": 16, "reference_examples": 16, "batch_size": 4, "seeds": "0", "order": "I"}


class StreamSpec:
    """One benchmarked stream: its fixed orders, the task keys it takes, and how to build it from them."""

    def __init__(self, name: str, orders: dict[str, tuple[str, ...]], keys: tuple[str, ...],
                 build: Callable[..., Any]) -> None:
        self.name, self.orders, self.keys, self._build = name, orders, keys, build

    def build(self, keys: list[str], train: int, evaluate: int) -> Any:
        return self._build(tuple(keys), max_train_per_task=train, max_eval_per_task=evaluate)


STREAMS = {
    "pacs-domains": StreamSpec("pacs-domains", PACS_ORDERS, PACS_DOMAINS,
                               lambda keys, **sizes: build_stream("pacs-domains", domains=keys, **sizes)),
    "mtil-heldout": StreamSpec("mtil-heldout", MTIL_HELDOUT_ORDERS, MTIL_HELDOUT_TASKS,
                               lambda keys, **sizes: build_stream("mtil-heldout", tasks=keys, **sizes)),
}


def ensemble_every(options) -> int:
    """ZSCL's weight-ensemble period at this scale: about a tenth of a task's steps (ZSCL: 100 of 1000), at least 1."""
    if options.ensemble_every is not None:
        return options.ensemble_every
    steps = max(1, round(options.train_per_task * options.epochs / options.batch_size))  # as `budget`
    return max(1, round(steps / 10))


def family_args(name: str, options) -> dict:
    """The method's options at this scale (see `WHY`); ER, WiSE-FT, ZSCL and MoE-Adapters as `benchmarks/mtil.py`."""
    own = {
        "ctp": {"queue_size": 4 * options.batch_size, "fix_temperature": False},
        "derpp": {"buffer_size": options.buffer_size},
        "dns": {"project": "update"},
        "gem": {"memory_per_task": options.memory_per_task},
        "agem": {"memory_per_task": options.memory_per_task, "reference_batch_size": options.batch_size},
        "patching": {"validation_size": 0.1},
        "lora": {"r": 8, "alpha": 8.0},
        "prompt": {"ctx_init": "a photo of a", "schedule": "shared"},
        "weight_ensemble": {"every": options.ensemble_every},
        "rail": {"hidden_dim": options.rail_hidden_dim},
        "lada": {"text_tuning": "adaptformer"},
    }
    if name in own:
        return {name: own[name]}
    return mtil_method_args(name, options)


def learning_rate(name: str, options) -> float:
    return {"moe_adapters": options.moe_lr, "lora": options.lora_lr, "prompt": options.prompt_lr,
            "diki": options.diki_lr, "c_clip": options.c_clip_lr, "lada": options.lada_lr}.get(name, options.lr)


def budget(stream, options) -> int:
    """The compute budget C (`samples_per_task`) of every method but joint: the mean task size x epochs, in whole
    batches, so that replay, TiC's strategies and the rest see as many examples per task as finetune."""
    size = statistics.fmean(len(task.train) for task in stream) * options.epochs
    return max(1, round(size / options.batch_size)) * options.batch_size


def classification_loss(name: str) -> str:
    """The image-to-class-prompt cross-entropy every method trains with, but a method whose own terms are the whole
    loss (lada), which the library refuses beside it."""
    return "contrastive" if get_method_class(name).replaces_contrastive_loss else "cross_entropy"


def learner(name: str, start, stream, image_size: int, options, seed: int, output_dir: Path,
            callbacks: list, task_callbacks: list, class_scope: str = "task") -> ContinualLearner:
    """The run of `name` on `stream` (refused with a ValueError when the library cannot run it there), each
    classification task scored among the classes of `class_scope` (`ContinualArguments.class_scope`)."""
    return ContinualLearner(
        copy.deepcopy(start), stream, build_methods([name], family_args(name, options)),
        load_image_processor(image_size), load_tokenizer(),
        ContinualArguments(output_dir=str(output_dir), save_checkpoints=False, progress=False, seed=seed,
                           overwrite_output_dir=True, classification_loss=classification_loss(name),
                           class_scope=class_scope,
                           samples_per_task=None if name == "joint" else budget(stream, options),
                           training={"num_train_epochs": options.epochs,
                                     "per_device_train_batch_size": options.batch_size,
                                     "learning_rate": learning_rate(name, options), "weight_decay": 0.1,
                                     "warmup_steps": 0.1, "lr_scheduler_type": "cosine", "logging_steps": 50}),
        callbacks=callbacks, task_callbacks=task_callbacks,
    )


def run(name: str, start, stream, image_size: int, order: str, options, seed: int, control: Any,
        above: list[bool], class_scope: str = "task") -> dict:
    times, kept = StepTimes(), ControlRetrieval(control)
    folder = Path(options.runs_dir) / f"{stream.name}-{name}-{order}-{seed}"
    run_learner = learner(name, start, stream, image_size, options, seed, folder, [times], [kept], class_scope)
    results = run_learner.fit()
    R, b = results.headline(), results.initial_headline()
    columns = [j for j, a in enumerate(above) if a]
    zero = np.tile(b, (len(b), 1))
    return {
        "stream": stream.name, "method": name, "seed": seed, "order": order, "tasks": stream.task_names,
        "R": R.tolist(), "initial": b.tolist(), "last": mtil_last(R), "average": mtil_average(R),
        "transfer": mtil_transfer(R), "transfer_above": transfer_over(R, columns), "plasticity": plasticity(R),
        "forgetting": forgetting(R), "control": kept.scores, "control_last": kept.scores[-1],
        "zero_shot": float(np.mean(b)), "zero_shot_transfer": mtil_transfer(zero),
        "zero_shot_transfer_above": transfer_over(zero, columns),
        "median_step_s": statistics.median(times.times) if times.times else math.nan,
        "cost": run_cost(run_learner.compute),
    }


def refusals(names: list[str], start, streams: dict[str, Any], image_size: int, options,
             class_scope: str = "task") -> dict[tuple, str]:
    """(stream, method) -> the library's reason, for every method it refuses on a stream, found by building each
    run once (nothing trains) before any run starts."""
    refused = {}
    with tempfile.TemporaryDirectory(prefix="hf_ccl_families_check_") as folder:
        for stream_name, stream in streams.items():
            for name in names:
                try:
                    learner(name, start, stream, image_size, options, 0, Path(folder) / name, [], [], class_scope)
                except ValueError as error:  # ConfigError and the methods' check_stream refusals
                    refused[(stream_name, name)] = str(error)
    return refused


# ----------------------------------------------------------------------------------------------------------------
# Tables and plot
# ----------------------------------------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def _cell(text: str) -> str:
    """`text` as one markdown table cell (no pipes, no line breaks)."""
    return " ".join(text.split()).replace("|", "\\|")


KEYS = ("last", "average", "transfer", "transfer_above", "plasticity", "forgetting", "control_last")


def stream_verdicts(runs: list[dict]) -> list:
    """Each method vs finetune on Last and on Transfer, paired by (order, seed)."""
    base = {(r["order"], r["seed"]): r for r in runs if r["method"] == "finetune"}
    found = []
    for method in dict.fromkeys(r["method"] for r in runs):
        if method == "finetune":
            continue
        mine = [(r, base[(r["order"], r["seed"])]) for r in runs if r["method"] == method
                and (r["order"], r["seed"]) in base]
        if not mine:
            continue
        for claim, key in ((f"{method}'s Last is above finetune's", "last"),
                           (f"{method} keeps Transfer better than finetune", "transfer")):
            found.append(paired_verdict(claim, [a[key] for a, _ in mine], [b[key] for _, b in mine]))
    return found


def stream_table(stream_name: str, runs: list[dict], refused: dict[tuple, str], failed: dict[tuple, list[str]],
                 methods: list[str], start: dict, families: dict[str, str] = FAMILIES) -> list[str]:
    info = start["streams"][stream_name]
    above = [task for task, a in zip(info["tasks"], info["above"], strict=True) if a]
    orders = {(r["order"], " -> ".join(r["tasks"])) for r in runs}
    lines = [f"## `{stream_name}`", "", f"Orders run: {'; '.join(f'{o}: {t}' for o, t in sorted(orders)) or 'none'}. "
             f"Tasks where the starting model is above the majority rate by 2 SE (Transfer (above)): "
             f"{', '.join(above) or 'none'}.", "",
             "Eval subsets, with the starting model's zero-shot accuracy ± binomial SE:", ""]
    cells = baseline_cells([eval_baseline_from(b) for b in info["baselines"]])
    cells[0] += " starting model |"
    cells[1] += "---|"
    for i, b in enumerate(info["baselines"]):
        cells[i + 2] += f" {format_score(b['score'], b['n'])} |"
    lines += [*cells, ""]
    header = ("| method | family | Last | Avg. | Transfer | Transfer (above) | plasticity | forgetting | control | "
              "time/step vs finetune | " + " | ".join(RUN_COST_HEADER) + " |")
    width = 10 + len(RUN_COST_HEADER)
    lines += [header, "|---" * width + "|"]
    zero = [r for r in runs if r["method"] == methods[0]] or runs
    lines.append(f"| zero-shot model | | {_mean_std([r['zero_shot'] for r in zero])} | "
                 f"{_mean_std([r['zero_shot'] for r in zero])} | {_mean_std([r['zero_shot_transfer'] for r in zero])} "
                 f"| {_mean_std([r['zero_shot_transfer_above'] for r in zero])} | | | {start['control']:.1f} |"
                 + " |" * (1 + len(RUN_COST_HEADER)))
    base = {(r["order"], r["seed"]): r["median_step_s"] for r in runs if r["method"] == "finetune"}
    for method in methods:
        family = families.get(method, "")
        if (stream_name, method) in refused:
            lines.append(f"| {method} | {family} | cannot run here: {_cell(refused[(stream_name, method)])} |"
                         + " |" * (width - 3))
            continue
        mine = [r for r in runs if r["method"] == method]
        errors = failed.get((stream_name, method), [])
        if errors:
            lines.append(f"| {method} | {family} | **failed** in {len(errors)} of {len(errors) + len(mine)} runs: "
                         f"{_cell(errors[0])} |" + " |" * (width - 3))
        if not mine:
            continue
        ratios = [r["median_step_s"] / base[(r["order"], r["seed"])] for r in mine if (r["order"], r["seed"]) in base
                  and not math.isnan(r["median_step_s"])]  # a method that takes no step (rail) has no step time
        ratio = f"{np.mean(ratios):.2f}" if ratios else "-"
        lines.append(f"| {method} | {family} | " + " | ".join(_mean_std([r[k] for r in mine]) for k in KEYS)
                     + f" | {ratio} | {run_cost_cells(mean_run_cost([r['cost'] for r in mine]))} |")
    finals = {}
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if mine:  # each task's score after the last task, by task name (orders permute the columns)
            finals[method] = {task: float(np.mean([r["R"][-1][r["tasks"].index(task)] for r in mine]))
                              for task in info["tasks"] if all(task in r["tasks"] for r in mine)}
    if finals:
        lines += ["", "Each task's accuracy after the last task (mean over pairs; ± the binomial SE of one run's "
                  "score on the eval subset):", "",
                  *score_table("method", finals, [eval_baseline_from(b) for b in info["baselines"]])]
    verdicts = stream_verdicts(runs)
    if verdicts:
        lines += ["", "Against finetune, from paired per-(order, seed) differences (a - b), 95% t-interval:", "",
                  *verdict_table(verdicts)]
    return [*lines, ""]


def eval_baseline_from(record: dict) -> TaskBaseline:
    """A `TaskBaseline` back from its JSON record."""
    return TaskBaseline(record["task"], record["n"], record["n_classes"], record["chance"], record["majority"])


def config_lines(methods: list[str], options, families: dict[str, str] = FAMILIES,
                 why: dict[str, str] = WHY) -> list[str]:
    lines = ["| method | family | options | lr | why |", "|---|---|---|---|---|"]
    for method in methods:
        args = family_args(method, options).get(method, {})
        options_text = ", ".join(f"{k}: {v}" for k, v in args.items()) or "defaults"
        lines.append(f"| {method} | {families.get(method, '')} | {options_text} | {learning_rate(method, options):g} "
                     f"| {why.get(method, '')} |")
    return lines


def write(runs: list[dict], refused: dict[tuple, str], failed: dict[tuple, list[str]], start: dict, options,
          command: str) -> None:
    methods = options.methods
    orders = sorted({r["order"] for r in runs}) or options.order
    seeds = sorted({r["seed"] for r in runs}) or options.seeds
    lines = [
        "# Every family on the same streams",
        "",
        f"Command: `{command}`  ",
        f"Starting model: `benchmarks/pretrain_start.py` ({start['model']}, {start['recipe']['epochs']:g} epochs; "
        f"control Flickr8k-en test R_mean {start['control']:.1f} on {options.control_examples} images). Budget: "
        f"{options.train_per_task} training images per task and C = {options.train_per_task} x {options.epochs:g} "
        f"epoch(s) samples per task in whole batches (`samples_per_task`: every method sees as many examples per task, "
        f"replayed ones included; joint and oracle train more by design, see below), "
        f"batch {options.batch_size}, cosine with 10% warmup, weight decay 0.1, lr {options.lr:g} (where the table "
        f"below says otherwise: parameter-efficient methods train few, zero- or freshly-initialised parameters), "
        f"the image-to-class-prompt cross-entropy; each task scored task-aware on {options.eval_per_task} stratified "
        f"eval images. Orders {', '.join(orders)}; seeds {', '.join(map(str, seeds))}; mean ± std over (order, seed) "
        "pairs.",
        "",
        "Last / Avg. / Transfer as ZSCL's `mtil/results.ipynb` (Transfer: per task j >= 1 the mean of its accuracy at "
        "the steps before it is trained; on pacs-domains, the accuracy on domains not trained yet). **Transfer "
        "(above)**: the same over the tasks where the starting model is above the majority rate by 2 SE. "
        "**Plasticity**: mean accuracy right after training each task; **forgetting**: mean drop from a task's best "
        "to its last accuracy. **Control**: Flickr8k-en test retrieval R_mean after the last task.",
        "",
        "Configurations (what a user would set at this scale):",
        "",
        *config_lines(methods, options),
        "",
        "Not compared here: " + "; ".join(f"{k}: {v}" for k, v in NOT_COMPARED.items()) + ".",
        "",
    ]
    for stream_name in options.streams:
        lines += stream_table(stream_name, [r for r in runs if r["stream"] == stream_name], refused, failed, methods,
                              start)
    lines += [RUN_COST_NOTE, ""]
    results_path(options.output, ".md").write_text("\n".join(lines), encoding="utf-8")
    record = {"start": start, "runs": runs,
              "refused": [{"stream": s, "method": m, "reason": why} for (s, m), why in refused.items()],
              "failed": [{"stream": s, "method": m, "errors": errors} for (s, m), errors in failed.items()]}
    results_path(options.output, ".json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def plot(runs: list[dict], start: dict, options) -> None:
    """Per stream, Last vs Transfer per method (mean over pairs), with the zero-shot model's lines."""
    from matplotlib.figure import Figure

    streams = [s for s in options.streams if any(r["stream"] == s for r in runs)]
    if not streams:
        return
    figure = Figure(figsize=(6.5 * len(streams), 5.5), layout="constrained")
    families = list(dict.fromkeys(FAMILIES.get(r["method"], "other") for r in runs))
    colours = {family: f"C{i % 10}" for i, family in enumerate(families)}
    for axes, stream_name in zip(np.atleast_1d(figure.subplots(1, len(streams))), streams, strict=True):
        mine = [r for r in runs if r["stream"] == stream_name]
        shown = set()
        for method in dict.fromkeys(r["method"] for r in mine):
            rows = [r for r in mine if r["method"] == method]
            x, y = np.mean([r["last"] for r in rows]), np.mean([r["transfer"] for r in rows])
            family = FAMILIES.get(method, "other")
            axes.scatter(x, y, s=22, color=colours[family], label=None if family in shown else family)
            shown.add(family)
            axes.annotate(method, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes.axvline(np.mean([r["zero_shot"] for r in mine]), color="grey", linestyle="--", linewidth=1,
                     label="zero-shot model: Last")
        axes.axhline(np.mean([r["zero_shot_transfer"] for r in mine]), color="grey", linestyle=":", linewidth=1,
                     label="zero-shot model: Transfer")
        axes.set_xlabel("Last (%)")
        axes.set_ylabel("Transfer (%)")
        axes.set_title(f"{stream_name}: Last vs Transfer")
        axes.legend(fontsize=6)
    figure.savefig(results_path(options.output, ".png"), dpi=120)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def _sizes(text: str) -> dict[str, int]:
    sizes = json.loads(text)
    if not isinstance(sizes, dict) or not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of positive integer sizes, got {text!r}")
    return sizes


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def parser(description: str | None = __doc__, streams: dict[str, StreamSpec] = STREAMS,
           tasks_help: str | None = None) -> argparse.ArgumentParser:
    """The options; `description`, `streams` and `tasks_help` (what `--tasks` takes) let another benchmark reuse it."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes (a tiny starting model pretrained for a few steps, cached beside the real "
                             f"one under its own hash; {SMOKE['train_per_task']} train / {SMOKE['eval_per_task']} eval images per "
                             "task, one seed, order I): checks that every method runs; options given still win")
    parser.add_argument("--methods", default=METHODS, help="comma-separated methods; default every family's")
    parser.add_argument("--streams", default=",".join(streams), help=f"comma-separated, of {', '.join(streams)}")
    parser.add_argument("--train-per-task", type=_positive(int), default=300)
    parser.add_argument("--eval-per-task", type=_positive(int), default=300)
    parser.add_argument("--control-examples", type=_positive(int), default=300)
    parser.add_argument("--epochs", type=_positive(float), default=1.0)
    parser.add_argument("--batch-size", type=_positive(int), default=64)
    parser.add_argument("--lr", type=_positive(float), default=3e-4, help="every method's but the three below")
    parser.add_argument("--moe-lr", type=_positive(float), default=2e-2,
                        help="moe_adapters' (zero-initialised experts scaled by 0.1; as benchmarks/mtil.py)")
    parser.add_argument("--lora-lr", type=_positive(float), default=1e-3, help="lora's (zero-initialised B)")
    parser.add_argument("--prompt-lr", type=_positive(float), default=2e-3, help="prompt's (CoOp: 2e-3)")
    parser.add_argument("--c-clip-lr", type=_positive(float), default=1e-2,
                        help="c_clip's LoRA (probed on pacs-domains, order I, seed 0: 1e-3 did not learn, plasticity "
                             "18.6 = the zero-shot 18.4; 1e-2: 29.7; 5e-2: 14.9, diverged)")
    parser.add_argument("--diki-lr", type=_positive(float), default=2e-3,
                        help="diki's prompts (the official code: SGD at 5.0; this table trains with AdamW, as prompt)")
    parser.add_argument("--lada-lr", type=_positive(float), default=1e-3,
                        help="lada's text features and memory units (benchmarks/xtail.py; not tuned)")
    parser.add_argument("--rail-hidden-dim", type=_positive(int), default=2048,
                        help="rail's random hidden layer (benchmarks/xtail.py; the official 15000 inverts a "
                             "15000 x 15000 memory, minutes on 2 cores)")
    parser.add_argument("--buffer-size", type=_positive(int), default=200, help="er and derpp buffers")
    parser.add_argument("--memory-per-task", type=_positive(int), default=50, help="gem and agem memories")
    parser.add_argument("--wise-alpha", type=float, default=0.8)
    parser.add_argument("--reference-examples", type=_positive(int), default=2000, help="zscl's Flickr8k rows")
    parser.add_argument("--ensemble-every", type=_positive(int), default=None,
                        help="zscl's and weight_ensemble's averaging period in steps; default about a tenth of a "
                             "task's steps")
    parser.add_argument("--moe-bottleneck", type=_positive(int), default=16)
    parser.add_argument("--start-model", type=_sizes, default=MODEL,
                        help="the starting model's tiny_clip sizes as JSON (default pretrain_start.MODEL)")
    parser.add_argument("--start-epochs", type=_positive(float), default=RECIPE["epochs"],
                        help="the starting model's pretraining epochs")
    parser.add_argument("--start-cache", type=Path, default=DEFAULT_CACHE,
                        help="where the starting model is cached, in a folder named by a hash of its sizes and recipe "
                             "(default %(default)s, pretrain_start's)")
    add_stream_arguments(parser, default_output=str(Path(__file__).parent / "results" / "families"),
                         default_seeds="0,1",
                         tasks_help=tasks_help or "comma-separated task keys in the order given: PACS domains "
                                    f"({', '.join(PACS_DOMAINS)}) for pacs-domains, mtil-heldout keys "
                                    f"({', '.join(MTIL_HELDOUT_TASKS)}) for mtil-heldout; a stream none are named "
                                    "for keeps its orders")
    parser.set_defaults(order="I")
    return parser


def parse(argv: list[str] | None = None, parse_parser: argparse.ArgumentParser | None = None,
          streams: dict[str, StreamSpec] = STREAMS, smoke_defaults: dict | None = None) -> argparse.Namespace:
    """Parsed options, every value checked (`--smoke` changes the defaults only: `smoke_defaults`, default
    `SMOKE`); `parse_parser` (default `parser()`) and `streams` let another benchmark reuse it."""
    parse_parser = parse_parser or parser()
    smoke, _ = parse_parser.parse_known_args(argv)
    if smoke.smoke:
        parse_parser.set_defaults(**(SMOKE if smoke_defaults is None else smoke_defaults))
    options = parse_parser.parse_args(argv)
    options.methods = [m.strip() for m in options.methods.split(",") if m.strip()]
    options.streams = [s.strip() for s in options.streams.split(",") if s.strip()]
    if len(set(options.methods)) != len(options.methods) or not options.methods:
        parse_parser.error(f"--methods must name each method once, got {','.join(options.methods)!r}")
    for name in options.methods:
        try:
            get_method_class(name)
        except ConfigError as error:
            parse_parser.error(f"--methods: {error}")
    unknown = [s for s in options.streams if s not in streams]
    if unknown or not options.streams:
        parse_parser.error(f"--streams: unknown {unknown}; valid: {', '.join(streams)}")
    if options.tasks:
        known = {key for name in options.streams for key in streams[name].keys}
        stray = [t for t in options.tasks if t not in known]
        if stray:
            parse_parser.error(f"--tasks: {stray} belong to none of the streams {', '.join(options.streams)}")
    options.ensemble_every = ensemble_every(options)
    return options


def stream_tasks(name: str, options, streams: dict[str, StreamSpec] = STREAMS) -> list[str] | None:
    """The `--tasks` keys that belong to stream `name` (of `streams`), or None."""
    mine = [t for t in options.tasks or [] if t in streams[name].keys]
    return mine or None


def starting_point(options) -> tuple[Any, dict, int]:
    """The starting model, its record (sizes, recipe, control) and its image size."""
    recipe = {**RECIPE, "epochs": options.start_epochs}
    folder = ensure_start_model(options.start_model, recipe, options.start_cache)
    return load_start_model(folder), {"model": options.start_model, "recipe": recipe, "folder": str(folder)}, \
        options.start_model.get("image_size", TINY_CLIP["image_size"])


def scope_baseline(task: Any, stream: Any, class_scope: str = "task") -> TaskBaseline:
    """`eval_baseline` of `task` scored among the classes of `class_scope` (before any task is trained): under
    `all`, chance is 100 / the stream's candidate classes (each name once) and majority the largest class's share
    of the task's eval rows (a constant guess among the candidates can do no better)."""
    b = eval_baseline(task)
    names = scope_class_names(list(stream), 0, task, class_scope)
    return b if not names else dataclasses.replace(b, n_classes=len(names), chance=100.0 / len(names))


def start_score(model, task: Any, stream: Any, processor, tokenizer, class_scope: str = "task") -> float:
    """The headline of `model` on `task` under `class_scope` before any task is trained (as the learner scores it)."""
    names = scope_class_names(list(stream), 0, task, class_scope)
    scope = {"seen_class_names": names, "class_scope": class_scope} if names else {}
    return evaluate_task(model, task, processor, tokenizer, **scope)[task.kind_spec.headline(class_scope)]


def stream_start(name: str, spec: StreamSpec, start_model, processor, tokenizer, options,
                 class_scope: str = "task") -> tuple[dict, dict, Any]:
    """The starting model's record on stream `name` (its tasks, their chance and majority rates (`scope_baseline`)
    with its score, above the majority or not), the above-majority flag per (stream, task), and the stream in its
    first order at the run sizes (for `refusals`)."""
    keys = stream_tasks(name, options, {name: spec}) or list(spec.orders["I"])
    reference = spec.build(keys, 1, options.eval_per_task)
    baselines, above = [], {}
    for task in reference:
        b = scope_baseline(task, reference, class_scope)
        score = start_score(start_model, task, reference, processor, tokenizer, class_scope)
        above[(name, task.name)] = above_majority(score, b)
        baselines.append({**vars(b), "score": score})
    record = {"tasks": [t.name for t in reference], "baselines": baselines,
              "above": [above[(name, t.name)] for t in reference]}
    return record, above, spec.build(keys, options.train_per_task, options.eval_per_task)


def compare(options, specs: dict[str, StreamSpec], start_model, start: dict, image_size: int,
            write_results: Callable[[list[dict], dict, dict], None], class_scope: str = "task",
            ) -> tuple[list[dict], dict[tuple, list[str]]]:
    """Every (seed, stream, order, method) run of `options`, each classification task scored among `class_scope`'s
    classes; `start` gains the control score and each stream's record (`stream_start`), `write_results(runs,
    refused, failed)` is called after every run. Returns the runs and the failures ((stream, method) -> errors)."""
    tokenizer, processor = load_tokenizer(), load_image_processor(image_size)
    control = control_task(options)
    start["control"] = evaluate_task(start_model, control, processor, tokenizer)["R_mean"]
    start["streams"], above_by_task, first_streams = {}, {}, {}
    for name in options.streams:
        start["streams"][name], above, first_streams[name] = stream_start(
            name, specs[name], start_model, processor, tokenizer, options, class_scope)
        above_by_task.update(above)
    refused = refusals(options.methods, start_model, first_streams, image_size, options, class_scope)
    for (stream_name, method), why in refused.items():
        print(f"{method} cannot run on {stream_name}: {why}", flush=True)
    runs: list[dict] = []
    failed: dict[tuple, list[str]] = {}
    for seed in options.seeds:
        for name in options.streams:
            spec = specs[name]
            tasks = stream_tasks(name, options, specs)
            for order, keys in task_orders(options.order, spec.orders, tasks, seed).items():
                stream = spec.build(keys, options.train_per_task, options.eval_per_task)
                above = [above_by_task[(name, task)] for task in stream.task_names]
                for method in options.methods:
                    if (name, method) in refused:
                        continue
                    started = time.perf_counter()
                    torch.manual_seed(seed)
                    try:
                        runs.append(run(method, start_model, stream, image_size, order, options, seed, control,
                                        above, class_scope))
                    except Exception as error:  # noqa: BLE001 -- in the table, on stderr and in the exit status
                        traceback.print_exc()
                        failed.setdefault((name, method), []).append(f"{type(error).__name__}: {error}")
                        print(f"{name} {method} order {order} seed {seed}: FAILED", flush=True)
                    else:
                        print(f"{name} {method} order {order} seed {seed}: {time.perf_counter() - started:.0f} s; "
                              f"Last {runs[-1]['last']:.1f}, Transfer {runs[-1]['transfer']:.1f}", flush=True)
                    gc.collect()  # the next run's peak memory should not include this one's learner
                    write_results(runs, refused, failed)
    write_results(runs, refused, failed)
    return runs, failed


def exit_on_failures(failed: dict[tuple, list[str]]) -> None:
    """Exit non-zero with one line naming each method that failed, if any did."""
    if failed:
        sys.exit("hf-ccl: error: runs failed (see the table and the tracebacks above): "
                 + "; ".join(f"{m} on {s} ({len(e)} run(s)): {e[0]}" for (s, m), e in failed.items()))


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    command = "python benchmarks/families.py " + " ".join(sys.argv[1:] if argv is None else argv)
    start_model, start, image_size = starting_point(options)
    runs, failed = compare(options, STREAMS, start_model, start, image_size,
                           lambda runs, refused, failed: write(runs, refused, failed, start, options, command))
    plot(runs, start, options)
    print(results_path(options.output, ".md").read_text(encoding="utf-8")[:8000], flush=True)
    exit_on_failures(failed)


if __name__ == "__main__":
    main()
