"""New languages without forgetting (CLL-CLIP, paper 002) at small scale: does TEIR lower forgetting?

A random CLIP is pretrained on English Flickr8k (all weights, `--pretrain-epochs`), then learns the languages of
`--languages` one at a time (English first, as in the paper: it trains the token embeddings like every other task).
Every configuration starts from the same English model, grows the tokenizer per language (`grow_vocab`, English
skipped) and is run with and without TEIR:

    cllclip            [cllclip, grow_vocab]                 cllclip+teir   [..., teir]
    er                 [cllclip, grow_vocab, er]             er+teir        [..., teir]
    lora               [cllclip, grow_vocab, lora]           lora+teir      [..., teir]
    prompt             [cllclip, grow_vocab, prompt]         prompt+teir    [..., teir]

(lora and prompt train their adapter / context vectors and the token embedding.) Per configuration: the per-language
R@1 matrix (mean of image-to-text and text-to-image), the paper's Average Recall AR_T and Forgetting F_T at the end
(specs/cllclip.md §7, on both directions), the drift of the English token-embedding rows (relative L2 change of the
original 49,408 rows), and the median time per step relative to `cllclip`.

Plasticity (the R@1 on each language right after learning it) stands beside forgetting, each per-language score
beside its binomial standard error (`protocol.py`), and "TEIR forgets less" / "TEIR ends higher" are judged per
configuration from runs paired by (order, seed). Orders: `I` (en, de, fr, cs, zh, or `--tasks` as given) and
`random` (English first, the other languages permuted per seed).

    python benchmarks/languages.py [--tasks en,de,fr,cs,zh] [--order I,random] [--train-per-language 1000]
        [--seeds 0,1,2] [--output PREFIX] [--runs-dir DIR]

Writes <output>.md/.json (default benchmarks/results/languages).
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
from transformers import TrainerCallback

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.continual_metrics import final_average, forgetting
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import tiny_clip

RESULTS = Path(__file__).parent / "results"
LANGUAGES = ("en", "de", "fr", "cs", "zh")  # order I: English first, as in the paper
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "projection_dim": 64, "image_size": 32}
TOKEN_EMBEDDING = "text_model.embeddings.token_embedding.weight"
CONFIGS = {
    "cllclip": ["cllclip", "grow_vocab"],
    "er": ["cllclip", "grow_vocab", "er"],
    "lora": ["cllclip", "grow_vocab", "lora"],
    "prompt": ["cllclip", "grow_vocab", "prompt"],
}


class EnglishRows(ContinualMethod):
    """Not a learning method: keeps the original 49,408 token rows as they are after the English task."""

    name = "english_rows"

    def __init__(self) -> None:
        super().__init__()
        self.rows: torch.Tensor | None = None

    def on_task_end(self, context) -> None:  # noqa: ANN001
        if context.task_index == 0:
            self.rows = context.model.get_input_embeddings().weight.detach()[:49408].clone()


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self._last = None

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def method_args(names: list[str], options) -> dict:
    args = {"grow_vocab": {"vocab_size": options.vocab_size, "skip_languages": ["en"]}}
    if "er" in names:
        args["er"] = {"buffer_size": options.buffer_size}
    if "lora" in names:
        args["lora"] = {"towers": ["text"], "trainable": [TOKEN_EMBEDDING]}
    if "prompt" in names:
        args["prompt"] = {"n_ctx": 4, "trainable": [TOKEN_EMBEDDING]}
    return args


def pretrain_english(options, seed: int, tokenizer) -> torch.nn.Module:
    stream = build_stream("flickr8k-languages", languages=["en"], max_train_per_task=options.pretrain_examples,
                          max_eval_per_task=options.eval_per_language)
    learner = ContinualLearner(
        tiny_clip(seed=seed, **MODEL), stream, build_methods(["finetune"]), load_image_processor(MODEL["image_size"]),
        tokenizer,
        ContinualArguments(output_dir=str(options.runs_dir / f"pretrain-{seed}"), save_checkpoints=False,
                           progress=False, seed=seed, evaluation={"initial": False},
                           training={"num_train_epochs": options.pretrain_epochs, "per_device_train_batch_size": 64,
                                     "learning_rate": 1e-3, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                                     "weight_decay": 0.0}),
    )
    results = learner.fit()
    print(f"English pretraining, seed {seed}: {results.rows[-1].metrics['en']}", flush=True)
    return learner.model


def run(label: str, names: list[str], english_model, stream, options, order: str, seed: int) -> dict:
    model = copy.deepcopy(english_model)
    english_rows = model.get_input_embeddings().weight.detach()[:49408].clone()
    times = StepTimes()
    snapshot = EnglishRows()
    learner = ContinualLearner(
        model, stream, [*build_methods(names, method_args(names, options)), snapshot],
        load_image_processor(MODEL["image_size"]),
        load_tokenizer(),
        ContinualArguments(output_dir=str(options.runs_dir / f"{label}-{order}-{seed}"), save_checkpoints=False,
                           progress=False, seed=seed,
                           training={"num_train_epochs": options.epochs, "per_device_train_batch_size": 64,
                                     "learning_rate": options.lr, "weight_decay": 0.05, "warmup_steps": 0.1,
                                     "lr_scheduler_type": "cosine", "logging_steps": 50}),
        callbacks=[times],
    )
    results = learner.fit()
    languages = stream.task_names
    rows = [row for row in results.rows if row.label != "initial"]
    i2t = np.array([[row.metrics[lang]["i2t_R@1"] for lang in languages] for row in rows])
    t2i = np.array([[row.metrics[lang]["t2i_R@1"] for lang in languages] for row in rows])
    after = learner.model.get_input_embeddings().weight.detach()[:49408]
    drift = float((after - english_rows).norm() / english_rows.norm())
    later_drift = float((after - snapshot.rows).norm() / snapshot.rows.norm())
    r1 = (i2t + t2i) / 2
    return {
        "config": label, "order": order, "seed": seed, "languages": languages, "methods": names, "r1": r1.tolist(),
        "AR_i2t": final_average(i2t), "AR_t2i": final_average(t2i), "F_i2t": forgetting(i2t),
        "F_t2i": forgetting(t2i), "plasticity": float(np.mean(np.diag(r1))),
        "english_drift": drift, "english_drift_after_en": later_drift,
        "median_step_s": statistics.median(times.times) if times.times else float("nan"),
        "vocab_size": len(learner.tokenizer),
        "cost": run_cost(learner.compute),
    }


def verdicts(runs: list[dict]) -> list:
    """Each configuration with TEIR against itself without, paired by (order, seed)."""
    by_key = {(r["config"], r["order"], r["seed"]): r for r in runs}
    out = []
    for config in dict.fromkeys(r["config"] for r in runs if not r["config"].endswith("+teir")):
        pairs = [(by_key[(config + "+teir", o, s)], r) for (c, o, s), r in by_key.items()
                 if c == config and (config + "+teir", o, s) in by_key]
        if not pairs:
            continue
        out.append(paired_verdict(f"{config}+teir forgets less than {config} (F, both directions)",
                                  [(r["F_i2t"] + r["F_t2i"]) / 2 for _, r in pairs],
                                  [(t["F_i2t"] + t["F_t2i"]) / 2 for t, _ in pairs]))
        out.append(paired_verdict(f"{config}+teir ends higher than {config} (AR, both directions)",
                                  [(t["AR_i2t"] + t["AR_t2i"]) / 2 for t, _ in pairs],
                                  [(r["AR_i2t"] + r["AR_t2i"]) / 2 for _, r in pairs]))
    return out


def write(runs: list[dict], stream, orders: dict, options, prefix: Path) -> None:
    configs = list(dict.fromkeys(r["config"] for r in runs))
    base = {(r["order"], r["seed"]): r["median_step_s"] for r in runs if r["config"] == "cllclip"}
    languages = stream.task_names
    baselines = [eval_baseline(task) for task in stream]
    order_text = "; ".join(f"{name} (seed {seed}): {', '.join(tasks)}" for (name, seed), tasks in orders.items())
    lines = [
        "# New languages without forgetting: CLL-CLIP and the baselines, with and without TEIR",
        "",
        f"Command: `python benchmarks/languages.py --tasks {','.join(languages)} --order {','.join(options.order)} "
        f"--train-per-language {options.train_per_language} --eval-per-language {options.eval_per_language} "
        f"--epochs {options.epochs} --pretrain-examples {options.pretrain_examples} "
        f"--pretrain-epochs {options.pretrain_epochs} --vocab-size {options.vocab_size} "
        f"--buffer-size {options.buffer_size} --lr {options.lr} --configs {options.configs} "
        f"--seeds {','.join(map(str, options.seeds))}`  ",
        f"A random CLIP {MODEL} pretrained on English Flickr8k ({options.pretrain_examples} images, "
        f"{options.pretrain_epochs} epochs, all weights), then the languages one per task in each order ("
        f"{order_text}; {options.train_per_language} images each, {options.epochs} epochs, batch 64); evaluation on "
        f"the same {options.eval_per_language} held-out images in every language. Growth: {options.vocab_size} new "
        "tokens per language (English not grown). AR_T and F_T as in the paper (specs/cllclip.md §7) on R@1 (%); "
        "plasticity = mean R@1 (both directions) on each language right after learning it; "
        "English drift = ‖ΔE‖/‖E‖ over the original 49,408 token rows, from the English-pretrained model (the English "
        "task trains them too) and from the end of the English task (what later languages do to them). Mean over "
        "runs (orders x seeds).",
        "",
        "| config | AR i2t | AR t2i | F i2t | F t2i | plasticity | English-row drift from the English model | ... "
        "after the English task | time/step vs cllclip | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (9 + len(RUN_COST_HEADER)) + "|",
    ]
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        keys = ("AR_i2t", "AR_t2i", "F_i2t", "F_t2i", "plasticity", "english_drift", "english_drift_after_en")
        mean = {key: float(np.mean([r[key] for r in mine])) for key in keys}
        ratio = float(np.mean([r["median_step_s"] / base.get((r["order"], r["seed"]), float("nan")) for r in mine]))
        lines.append(f"| {config} | {mean['AR_i2t']:.2f} | {mean['AR_t2i']:.2f} | {mean['F_i2t']:.2f} | "
                     f"{mean['F_t2i']:.2f} | {mean['plasticity']:.2f} | {mean['english_drift']:.4f} | "
                     f"{mean['english_drift_after_en']:.4f} | {ratio:.2f} | "
                     f"{run_cost_cells(mean_run_cost([r['cost'] for r in mine]))} |")
    lines += ["", RUN_COST_NOTE, "", "Claims, each configuration with TEIR against itself without:", ""]
    lines += verdict_table(verdicts(runs)) + ["", VERDICT_NOTE]
    lines += ["", "Per-language R@1 (mean of both directions; rows: after learning each language; mean over seeds), "
              "per order:", ""]
    for config in configs:
        for order in dict.fromkeys(r["order"] for r in runs if r["config"] == config):
            mine = [r for r in runs if r["config"] == config and r["order"] == order]
            matrix = np.mean([r["r1"] for r in mine], axis=0)
            trained = mine[0]["languages"]
            rows = {after: dict(zip(trained, values, strict=True)) for after, values in zip(trained, matrix,
                                                                                             strict=True)}
            lines += [f"**{config}**, order {order}", ""] + score_table("after \\ eval", rows, baselines) + [""]
    lines += [BASELINE_NOTE]
    results_path(prefix, ".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    results_path(prefix, ".json").write_text(
        json.dumps({"runs": runs, "orders": [[n, s, t] for (n, s), t in orders.items()]}, indent=2) + "\n",
        encoding="utf-8")
    print("\n".join(lines[:8 + len(configs)]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="cllclip,er,lora,prompt")
    parser.add_argument("--train-per-language", type=int, default=1000)
    parser.add_argument("--eval-per-language", type=int, default=200)
    parser.add_argument("--pretrain-examples", type=int, default=3000)
    parser.add_argument("--pretrain-epochs", type=float, default=10)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--buffer-size", type=int, default=200)
    parser.add_argument("--lr", type=float, default=5e-3)
    add_stream_arguments(
        parser, default_output=str(RESULTS / "languages"), orders=("I", "random"),
        tasks_help="comma-separated Flickr8k languages (en, de, fr, cs, zh, ug, bo, mn), one task each, English "
                   f"first (default {','.join(LANGUAGES)}: order I); 'random' keeps English first and permutes the "
                   "others",
    )
    options = parser.parse_args()
    given = options.tasks
    if given is not None and given[0] != "en":
        parser.error(f"--tasks must start with en (the model is pretrained on English and the English-row drift is "
                     f"measured after the English task), got {','.join(given)}")
    languages = list(given or LANGUAGES)
    unknown = [config for config in options.configs.split(",") if config not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
    try:
        stream = build_stream("flickr8k-languages", languages=languages,
                              max_train_per_task=options.train_per_language, max_eval_per_task=options.eval_per_language)
    except ValueError as error:
        parser.error(str(error))
    tokenizer = load_tokenizer()
    runs, orders = [], {}
    for seed in options.seeds:
        english = pretrain_english(options, seed, tokenizer)
        later = task_orders(options.order, {"I": list(LANGUAGES[1:])}, languages[1:] if given else None, seed)
        for order, rest in later.items():
            orders[(order, seed)] = ["en", *rest]
            ordered = reorder(stream, orders[(order, seed)])
            for config in options.configs.split(","):
                for teir in (False, True):
                    names = CONFIGS[config] + (["teir"] if teir else [])
                    label = config + ("+teir" if teir else "")
                    started = time.perf_counter()
                    runs.append(run(label, names, english, ordered, options, order, seed))
                    print(f"{label} order {order} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
                    write(runs, stream, orders, options, options.output)


if __name__ == "__main__":
    main()
