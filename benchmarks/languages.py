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

    python benchmarks/languages.py [--languages en,de,fr,cs,zh] [--train-per-language 1000] [--seeds 0]

Writes benchmarks/results/languages.md/.json.
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
from transformers import TrainerCallback

from hf_ccl.compute import RUN_COST_HEADER, RUN_COST_NOTE, mean_run_cost, run_cost, run_cost_cells
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.evaluation.continual_metrics import final_average, forgetting
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import tiny_clip

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
        ContinualArguments(output_dir=f"/tmp/hf_ccl_languages/pretrain-{seed}", save_checkpoints=False,
                           progress=False, seed=seed, evaluate_initial=False,
                           training={"num_train_epochs": options.pretrain_epochs, "per_device_train_batch_size": 64,
                                     "learning_rate": 1e-3, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                                     "weight_decay": 0.0}),
    )
    results = learner.fit()
    print(f"English pretraining, seed {seed}: {results.rows[-1].metrics['en']}", flush=True)
    return learner.model


def run(label: str, names: list[str], english_model, stream, options, seed: int) -> dict:
    model = copy.deepcopy(english_model)
    english_rows = model.get_input_embeddings().weight.detach()[:49408].clone()
    times = StepTimes()
    snapshot = EnglishRows()
    learner = ContinualLearner(
        model, stream, [*build_methods(names, method_args(names, options)), snapshot],
        load_image_processor(MODEL["image_size"]),
        load_tokenizer(),
        ContinualArguments(output_dir=f"/tmp/hf_ccl_languages/{label}-{seed}", save_checkpoints=False,
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
    return {
        "config": label, "seed": seed, "methods": names, "r1": ((i2t + t2i) / 2).tolist(),
        "AR_i2t": final_average(i2t), "AR_t2i": final_average(t2i), "F_i2t": forgetting(i2t),
        "F_t2i": forgetting(t2i), "english_drift": drift, "english_drift_after_en": later_drift,
        "median_step_s": statistics.median(times.times) if times.times else float("nan"),
        "vocab_size": len(learner.tokenizer),
        "cost": run_cost(learner.compute),
    }


def write(runs: list[dict], languages: list[str], options, path: Path) -> None:
    configs = list(dict.fromkeys(r["config"] for r in runs))
    base = {r["seed"]: r["median_step_s"] for r in runs if r["config"] == "cllclip"}
    lines = [
        "# New languages without forgetting: CLL-CLIP and the baselines, with and without TEIR",
        "",
        f"Command: `python benchmarks/languages.py --languages {options.languages} --train-per-language "
        f"{options.train_per_language} --eval-per-language {options.eval_per_language} --epochs {options.epochs} "
        f"--pretrain-examples {options.pretrain_examples} --pretrain-epochs {options.pretrain_epochs} "
        f"--vocab-size {options.vocab_size} --buffer-size {options.buffer_size} --lr {options.lr} "
        f"--configs {options.configs} --seeds {options.seeds}`  ",
        f"A random CLIP {MODEL} pretrained on English Flickr8k ({options.pretrain_examples} images, "
        f"{options.pretrain_epochs} epochs, all weights), then the languages {', '.join(languages)} one per task "
        f"({options.train_per_language} images each, {options.epochs} epochs, batch 64); evaluation on the same "
        f"{options.eval_per_language} held-out images in every language. Growth: {options.vocab_size} new tokens "
        "per language (English not grown). AR_T and F_T as in the paper (specs/cllclip.md §7) on R@1 (%); "
        "English drift = ‖ΔE‖/‖E‖ over the original 49,408 token rows, from the English-pretrained model (the English "
        "task trains them too) and from the end of the English task (what later languages do to them). Mean over "
        "seeds " + options.seeds + ".",
        "",
        "| config | AR i2t | AR t2i | F i2t | F t2i | English-row drift from the English model | ... after the "
        "English task | time/step vs cllclip | " + " | ".join(RUN_COST_HEADER) + " |",
        "|---" * (8 + len(RUN_COST_HEADER)) + "|",
    ]
    for config in configs:
        mine = [r for r in runs if r["config"] == config]
        keys = ("AR_i2t", "AR_t2i", "F_i2t", "F_t2i", "english_drift", "english_drift_after_en")
        mean = {key: float(np.mean([r[key] for r in mine])) for key in keys}
        ratio = float(np.mean([r["median_step_s"] / base.get(r["seed"], float("nan")) for r in mine]))
        lines.append(f"| {config} | {mean['AR_i2t']:.2f} | {mean['AR_t2i']:.2f} | {mean['F_i2t']:.2f} | "
                     f"{mean['F_t2i']:.2f} | {mean['english_drift']:.4f} | {mean['english_drift_after_en']:.4f} | "
                     f"{ratio:.2f} | {run_cost_cells(mean_run_cost([r['cost'] for r in mine]))} |")
    lines += ["", RUN_COST_NOTE, "", "Per-language R@1 (mean of both directions; rows: after learning each language; seed mean):", ""]
    for config in configs:
        matrix = np.mean([r["r1"] for r in runs if r["config"] == config], axis=0)
        lines += [f"**{config}**", "", "| after \\ eval | " + " | ".join(languages) + " |",
                  "|---" * (len(languages) + 1) + "|"]
        for language, values in zip(languages, matrix, strict=True):
            lines.append(f"| {language} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
        lines.append("")
    path.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    path.with_suffix(".json").write_text(json.dumps(runs, indent=2) + "\n", encoding="utf-8")
    print("\n".join(lines[:8 + len(configs)]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--languages", default="en,de,fr,cs,zh")
    parser.add_argument("--configs", default="cllclip,er,lora,prompt")
    parser.add_argument("--train-per-language", type=int, default=1000)
    parser.add_argument("--eval-per-language", type=int, default=200)
    parser.add_argument("--pretrain-examples", type=int, default=3000)
    parser.add_argument("--pretrain-epochs", type=float, default=10)
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--buffer-size", type=int, default=200)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "languages"))
    options = parser.parse_args()
    languages = options.languages.split(",")
    stream = build_stream("flickr8k-languages", languages=languages, max_train_per_task=options.train_per_language,
                          max_eval_per_task=options.eval_per_language)
    tokenizer = load_tokenizer()
    runs = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        english = pretrain_english(options, seed, tokenizer)
        for config in options.configs.split(","):
            for teir in (False, True):
                names = CONFIGS[config] + (["teir"] if teir else [])
                label = config + ("+teir" if teir else "")
                started = time.perf_counter()
                runs.append(run(label, names, english, stream, options, seed))
                print(f"{label} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
                write(runs, languages, options, Path(options.output))


if __name__ == "__main__":
    main()
