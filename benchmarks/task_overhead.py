"""The fixed cost of a tiny task, by phase: where a 3-step task of a tiny CLIP spends its time outside training.

Runs the README's command in-process (`hf_ccl.cli.main(["train", "--config", "digits", ...])`, a CLIP of hidden
size 32 and one layer, 3 optimizer steps of 16 examples per task, 20 eval rows per task; 5 tasks), after one
warm-up run (imports, matplotlib's fonts), `--runs` times per variant, and reports per task:
- the loop's phases (`compute.json` "seconds": setup, train, eval, checkpoint, ...),
- inside the checkpoint: the model's and processor's save, the model card (its heatmap and its text), the
  manifest (each timed by wrapping the function where the package calls it),
- once per run: loading the tokenizer and building the stream.

Variants: `now` (this checkout) and `before` (the cuts of issue 27 undone in-process: the card template compiled
for every card, and the heatmap saved with `savefig`, which draws a constrained-layout figure twice). The tokenizer
is read from its folder at every load in both: a cached copy (`copy.deepcopy`) of the CLIP tokenizer decodes
differently (`a</w>dog</w>`), so that cut was withdrawn.

    python benchmarks/task_overhead.py [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "task_overhead.md"
OVERRIDES = [
    "progress=false", "training.max_steps=3", "training.per_device_train_batch_size=16",
    "stream_args.max_train_per_task=48", "stream_args.max_eval_per_task=20", "methods=[finetune]",
    "model.config.hidden_size=32", "model.config.num_layers=1",
]
#: Functions timed once per run (seconds per run, not per task): (module, attribute, label).
RUN_PARTS = [
    ("hf_ccl.data.collate", "load_tokenizer", "tokenizer load (per run)"),
    ("hf_ccl.data.named", "build_stream", "stream build (per run)"),
]
#: Functions timed inside the checkpoint phase: (module, attribute, label).
PARTS = [
    ("hf_ccl.modeling", "ContinualDualEncoder.save_pretrained", "model save_pretrained"),
    ("hf_ccl.processors", "save_processor", "processor save"),
    ("hf_ccl.cards", "write_model_card", "model card (total)"),
    ("hf_ccl.evaluation.plots", "plot_matrix_heatmap", "  heatmap png"),
    ("hf_ccl.cards", "build_model_card", "  card text"),
    ("hf_ccl.checkpoint_files", "write_manifest", "manifest"),
]


@contextlib.contextmanager
def replaced(module_name: str, attribute: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """Replace `module.attribute` (a dotted path inside the module) by `make(original)` wherever an hf_ccl module
    holds it (`from .x import f` copies), for the duration of the block."""
    import importlib

    importlib.import_module("hf_ccl.run")  # every module of a run first: one imported later would keep a copy
    owner: Any = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    holders = [owner] + [m for key, m in list(sys.modules.items())
                         if key.startswith("hf_ccl") and m is not owner and getattr(m, name, None) is original]
    replacement = make(original)
    for holder in holders:
        setattr(holder, name, replacement)
    try:
        yield
    finally:
        for holder in holders:
            setattr(holder, name, original)


def timer(label: str, seconds: dict[str, list[float]]) -> Callable[[Callable], Callable]:
    """A wrapper factory for `replaced`: the wrapped function's calls add their wall time to `seconds[label]`."""

    def make(original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label].append(time.perf_counter() - start)

        return wrapper

    return make


@contextlib.contextmanager
def timed_parts(seconds: dict[str, list[float]]) -> Iterator[None]:
    """Time each of `PARTS` and `RUN_PARTS` wherever the package calls it."""
    with contextlib.ExitStack() as stack:
        for module_name, attribute, label in PARTS + RUN_PARTS:
            stack.enter_context(replaced(module_name, attribute, timer(label, seconds)))
        yield


@contextlib.contextmanager
def before_cuts() -> Iterator[None]:
    """The per-task work as it was before issue 27's cuts (see the module docstring)."""
    import jinja2


    def compile_every_time(original: Callable) -> Callable:
        def compile_template(text: str) -> jinja2.Template:
            environment = jinja2.Environment(
                trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined
            )
            return environment.from_string(text)

        return compile_template

    def savefig(original: Callable) -> Callable:
        return lambda figure, path, dpi: figure.savefig(path, dpi=dpi)

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced("hf_ccl.cards", "_compiled_template", compile_every_time))
        stack.enter_context(replaced("hf_ccl.evaluation.plots", "save_png", savefig))
        yield


def one_run(folder: Path) -> dict[str, float]:
    """Seconds per task of each phase and part in one tiny run (means over its tasks)."""
    from hf_ccl.cli import main

    parts: dict[str, list[float]] = defaultdict(list)
    start = time.perf_counter()
    with timed_parts(parts), open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        code = main(["train", "--config", "digits", f"output_dir={folder}", *OVERRIDES])
    total = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the tiny run failed with exit code {code}")
    tasks = json.loads((folder / "compute.json").read_text())["tasks"]
    row: dict[str, float] = {"whole run (s, not per task)": total}
    for phase in tasks[0]["seconds"]:
        row[phase] = statistics.mean(task["seconds"][phase] for task in tasks)
    for _, _, label in PARTS:
        row[label] = sum(parts[label]) / len(tasks)
    for _, _, label in RUN_PARTS:
        row[label] = sum(parts[label])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        one_run(Path(tmp) / "warm-up")
        results: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
        for run in range(args.runs):  # interleaved, so that a change of load hits both variants alike
            with before_cuts():
                results["before"].append(one_run(Path(tmp) / f"before-{run}"))
            results["now"].append(one_run(Path(tmp) / f"now-{run}"))
    load_after = os.getloadavg()
    keys = list(results["now"][0])
    median = {variant: {key: statistics.median(r[key] for r in rows) for key in keys} for variant, rows in results.items()}
    lines = [
        "# Fixed cost of a tiny task, by phase",
        "",
        "A tiny digits run (5 tasks; CLIP hidden 32, 1 layer; 3 steps of 16 examples and 20 eval rows per task; "
        "method finetune), in one process after a warm-up run; median of "
        f"{args.runs} runs per variant, seconds per task (wall). `before`: the card template compiled for every "
        "card and the heatmap saved with `savefig` (two draws); `now`: this "
        "checkout. "
        f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; 1-minute load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (timings on a busy machine are longer). "
        "Written by `python benchmarks/task_overhead.py`.",
        "",
        "| phase (s per task) | before | now |",
        "|---|---|---|",
        *(f"| {key} | {median['before'][key]:.3f} | {median['now'][key]:.3f} |" for key in keys),
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
