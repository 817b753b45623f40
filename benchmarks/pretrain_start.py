"""The benchmarks' starting model: a small CLIP pretrained from scratch with real zero-shot ability (issue 26).

The continual methods that keep zero-shot (ZSCL, MoE-Adapters, WiSE-FT) need a starting model that has some. This
script pretrains a random CLIP (the real CLIP vocabulary) on every bundled captioned source plus a label dataset put
through varied caption templates, and holds out whole datasets so that the downstream stream (`mtil-heldout`:
cifar10, dtd10, pacs-photo, rsscn7, mnist; gtsrb when named) stays unseen:

    pretraining   Flickr8k train images with their English captions (6000 x 5), Fashion product titles (1608),
                  Caltech-101 train images (6096, 102 classes) captioned by CLIP_benchmark's 34 caltech101
                  templates (a random one per image and step): its classes share concepts with CIFAR-10 (airplanes,
                  cars, ships, animals) and PACS (dog, elephant, guitar, faces)
    held out      CIFAR-10, DTD, PACS (all four domains), RSSCN7, MNIST, GTSRB: never seen in pretraining

One task of the library's own loop (`ContinualLearner`, `finetune`, CLIP's contrastive loss; identical captions in a
batch are positives of each other), scored on Flickr8k's English test retrieval (the pretraining domain's control).
The model is cached under `--cache-dir` (default `~/.cache/hf_ccl/benchmarks`), in a folder named by a hash of
everything that makes it (sizes, sources, epochs, lr, batch, seed), with `start.json` beside it: that recipe, the
time it took, and its zero-shot table. It is never committed. `ensure_start_model(...)` returns the folder,
pretraining first when it is missing (the benchmarks call it).

Then its zero-shot accuracy on every held-out task's full test split (and, apart, on the seen-domain tasks) is
written next to chance, the majority-class rate of that split and the binomial standard error:

    python benchmarks/pretrain_start.py [--epochs 20] [--seed 0] [--output benchmarks/results/start_model]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from datasets import concatenate_datasets
from protocol import above_majority, binomial_se, eval_baseline

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.data.builders import TaskSource, stream_from_datasets
from hf_ccl.data.stream_registry import bundled
from hf_ccl.data.task import CANONICAL_COLUMNS, Task, TaskStream
from hf_ccl.data.templates import benchmark_templates
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import build_methods
from hf_ccl.modeling import ContinualCLIPModel
from hf_ccl.paths import data_root
from hf_ccl.testing import tiny_clip

#: The starting model's sizes: the largest that pretrains in well under an hour on 2 cores and leaves the
#: downstream grid (methods x orders x seeds) affordable; `--model` overrides.
MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "image_size": 32, "patch_size": 8,
         "projection_dim": 128}
RECIPE = {"epochs": 20.0, "batch_size": 128, "lr": 1e-3, "weight_decay": 0.1, "seed": 0}
SOURCES = ("flickr8k captions (en)", "fashion titles", "caltech101 x 34 CLIP_benchmark templates")
#: Held-out tasks a downstream benchmark reports Transfer on (`mtil-heldout` keys; pacs: photo), and the others.
HELD_OUT = ("cifar10", "dtd10", "pacs", "rsscn7", "mnist", "gtsrb")
OTHER_PACS_DOMAINS = ("art_painting", "cartoon", "sketch")
DEFAULT_CACHE = Path("~/.cache/hf_ccl/benchmarks").expanduser()


def pretraining_stream(root: Path | None = None) -> TaskStream:
    """One retrieval task: the train rows of every pretraining source, concatenated; eval: Flickr8k English test."""
    root = root or data_root()
    sources = [
        TaskSource(name="flickr8k", train=bundled(root, "flickr8k"), text_column="en"),
        TaskSource(name="fashion", train=bundled(root, "fashion"), text_column="title"),
        TaskSource(name="caltech101", train=bundled(root, "caltech101"), label_column="label",
                   train_templates=benchmark_templates("caltech101"),
                   eval_templates=benchmark_templates("caltech101")),
    ]
    parts = stream_from_datasets(sources, name="start-pretraining")
    trains = []
    for task in parts:
        rows = task.train.select_columns(list(CANONICAL_COLUMNS))
        trains.append(rows.remove_columns("label").add_column("label", [-1] * len(rows)))
    train = concatenate_datasets(trains).cast(trains[0].features)
    flickr = parts[0]
    mixed = Task(name="pretraining-mix", train=train, eval=flickr.eval, kind="retrieval", source="start-pretraining")
    return TaskStream("start-pretraining", [mixed])


def recipe_key(model: dict[str, int], recipe: dict[str, Any]) -> str:
    """A short hash of everything that makes the starting model."""
    text = json.dumps({"model": model, "recipe": recipe, "sources": SOURCES}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def start_model_folder(model: dict[str, int], recipe: dict[str, Any], cache_dir: Path = DEFAULT_CACHE) -> Path:
    return Path(cache_dir) / f"start-{recipe_key(model, recipe)}"


def pretrain(model_sizes: dict[str, int], recipe: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Pretrain and save the starting model to `folder` (written to a temporary sibling, then renamed)."""
    stream = pretraining_stream()
    tokenizer = load_tokenizer()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_ccl_start_") as runs:
        learner = ContinualLearner(
            tiny_clip(seed=recipe["seed"], **model_sizes), stream, build_methods(["finetune"]),
            load_image_processor(model_sizes["image_size"]), tokenizer,
            ContinualArguments(output_dir=os.path.join(runs, "run"), save_checkpoints=False, progress=False,
                               seed=recipe["seed"], evaluation={"initial": False},
                               training={"num_train_epochs": recipe["epochs"],
                                         "per_device_train_batch_size": recipe["batch_size"],
                                         "learning_rate": recipe["lr"], "weight_decay": recipe["weight_decay"],
                                         "warmup_steps": 0.05, "lr_scheduler_type": "cosine",
                                         "logging_steps": 100}),
        )
        results = learner.fit()
    elapsed = time.perf_counter() - started
    staging = folder.with_name(folder.name + ".partial")
    learner.model.save_pretrained(staging)
    record = {"model": model_sizes, "recipe": recipe, "sources": SOURCES, "held_out": HELD_OUT,
              "train_rows": len(stream[0].train), "pretrain_seconds": round(elapsed, 1),
              "flickr8k_en_test": results.rows[-1].metrics["pretraining-mix"]}
    (staging / "start.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    staging.rename(folder)
    return record


def ensure_start_model(model_sizes: dict[str, int] | None = None, recipe: dict[str, Any] | None = None,
                       cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The cached starting model's folder, pretrained first if it is missing."""
    model_sizes, recipe = model_sizes or MODEL, recipe or RECIPE
    folder = start_model_folder(model_sizes, recipe, cache_dir)
    if not (folder / "start.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        print(f"Pretraining the starting model into {folder} ...", flush=True)
        record = pretrain(model_sizes, recipe, folder)
        print(f"... {record['pretrain_seconds']:.0f} s; Flickr8k en test: {record['flickr8k_en_test']}", flush=True)
    return folder


def load_start_model(folder: Path) -> ContinualCLIPModel:
    return ContinualCLIPModel.from_pretrained(folder)


def zero_shot_rows(model: Any, image_size: int, tokenizer: Any) -> list[dict[str, Any]]:
    """The model's zero-shot accuracy on the full test split of every held-out task and seen-domain task."""
    processor = load_image_processor(image_size)
    held = build_stream("mtil-heldout", tasks=HELD_OUT)
    pacs = [build_stream("mtil-heldout", tasks=("pacs",), pacs_domain=d)[0] for d in OTHER_PACS_DOMAINS]
    seen = [build_stream("mtil-heldout", tasks=("caltech101",))[0],
            build_stream("mtil-bundled", tasks=("fashion",))[0]]
    rows = []
    for group, tasks in (("held out", [*held, *pacs]), ("seen in pretraining", seen)):
        for task in tasks:
            baseline = eval_baseline(task)
            accuracy = evaluate_task(model, task, processor, tokenizer)["accuracy"]
            rows.append({"task": task.name, "group": group, "n": baseline.n, "classes": baseline.n_classes,
                         "chance": baseline.chance, "majority": baseline.majority, "accuracy": accuracy,
                         "se": binomial_se(accuracy, baseline.n),
                         "above_majority": above_majority(accuracy, baseline)})
    return rows


def write_table(rows: list[dict[str, Any]], record: dict[str, Any], folder: Path, command: str, output: Path) -> None:
    lines = [
        "# The benchmarks' starting model: zero-shot on held-out tasks",
        "",
        f"Command: `{command}`  ",
        f"A random CLIP {record['model']} (real CLIP vocabulary) pretrained on {'; '.join(record['sources'])} "
        f"({record['train_rows']} images, {record['recipe']['epochs']:g} epochs, batch {record['recipe']['batch_size']}, "
        f"lr {record['recipe']['lr']:g}, weight decay {record['recipe']['weight_decay']:g}, cosine, seed "
        f"{record['recipe']['seed']}) in {record['pretrain_seconds'] / 60:.0f} min on this machine's 2 cores; cached "
        f"as `{folder.name}` (not committed; `benchmarks/pretrain_start.py` remakes it). Held out of pretraining: "
        f"{', '.join(record['held_out'])} (PACS: all four domains).",
        "",
        "Zero-shot accuracy (%) on each task's full test split, its own eval templates, task-aware; ± one binomial "
        "standard error; majority = the most frequent class's share of that split; **above** = accuracy - 2 SE > "
        "majority.",
        "",
        "| task | group | classes | test images | chance | majority | zero-shot ± SE | above majority |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['task']} | {r['group']} | {r['classes']} | {r['n']} | {r['chance']:.1f} | "
                     f"{r['majority']:.1f} | {r['accuracy']:.1f} ± {r['se']:.1f} | "
                     f"{'**above**' if r['above_majority'] else 'no'} |")
    flickr = record["flickr8k_en_test"]
    lines += ["", f"Control (the pretraining domain): Flickr8k English test retrieval, "
              f"R@1 i2t {flickr.get('i2t_R@1', float('nan')):.1f}, t2i {flickr.get('t2i_R@1', float('nan')):.1f}, "
              f"R_mean {flickr['R_mean']:.1f}.", ""]
    output.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    output.with_suffix(".json").write_text(json.dumps({"start": record, "zero_shot": rows}, indent=2) + "\n",
                                           encoding="utf-8")
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=float, default=RECIPE["epochs"])
    parser.add_argument("--batch-size", type=int, default=RECIPE["batch_size"])
    parser.add_argument("--lr", type=float, default=RECIPE["lr"])
    parser.add_argument("--seed", type=int, default=RECIPE["seed"])
    parser.add_argument("--model", type=json.loads, default=MODEL, help="tiny_clip sizes as JSON")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "start_model")
    options = parser.parse_args()
    recipe = {**RECIPE, "epochs": options.epochs, "batch_size": options.batch_size, "lr": options.lr,
              "seed": options.seed}
    folder = ensure_start_model(options.model, recipe, options.cache_dir)
    record = json.loads((folder / "start.json").read_text(encoding="utf-8"))
    command = (f"python benchmarks/pretrain_start.py --epochs {options.epochs:g} --batch-size {options.batch_size} "
               f"--lr {options.lr:g} --seed {options.seed} --model '{json.dumps(options.model)}'")
    rows = zero_shot_rows(load_start_model(folder), options.model["image_size"], load_tokenizer())
    write_table(rows, record, folder, command, options.output)


if __name__ == "__main__":
    main()
