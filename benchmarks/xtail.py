"""The task-agnostic methods on the X-TAIL protocol (issue 29, item 4): where to choose one without a task id.

X-TAIL (RAIL, NeurIPS 2024; LADA, ICML 2025; docs/protocols/x-tail-and-class-incremental.md) on bundled data:
stream `xtail-bundled` (caltech101 -> dtd10 -> rsscn7 -> mnist -> gtsrb, 16 training images per class, "a photo of
a {c}." for every domain), `class_scope: all`: after every task each eval image of every domain, trained or not, is
scored among the class names of every task of the stream (each name once; 172 with all five domains), with no
domain identity. Last / Avg. / Transfer as MTIL's (`hf_ccl.evaluation.continual_metrics`), which RAIL computes the
same way.

The machinery is `benchmarks/families.py`'s (imported, not copied): the same cached starting model
(`benchmarks/pretrain_start.py`), budget, seeds x orders, control column, paired verdicts against finetune and cost
columns; only the class scope, the stream and the methods differ. Chance is 100 / the number of candidate classes
and majority the largest class's share of a task's eval rows. Methods (`--methods`, default all):

    baseline                 finetune (the image-to-class-prompt cross-entropy, here among the classes seen so far)
    downstream               zscl, moe_adapters (task-agnostic routing, DDAS), diki (likelihood routing), condu
                             (semantic voting over its experts when no task is named)
    analytic                 rail (a closed-form regression on frozen features fused with zero-shot; trains nothing)
    parameter-efficient      lada (label-specific memory after the frozen image tower; its own loss)

    python benchmarks/xtail.py [--methods finetune,...] [--order I] [--seeds 0,1,2]
                               [--output benchmarks/results/xtail]
    python benchmarks/xtail.py --smoke --tasks dtd10,rsscn7 --output /tmp/xtail_smoke   # every method, tiny sizes

Writes <output>.md and <output>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import families  # benchmarks/ is on the path of `python benchmarks/xtail.py`
from protocol import results_path

from hf_ccl.compute import RUN_COST_NOTE
from hf_ccl.data import build_stream
from hf_ccl.data.xtail import XTAIL_BUNDLED_TASKS

STREAM = "xtail-bundled"
#: The scoring every run and the starting model's row use: every class of every task of the stream (X-TAIL).
CLASS_SCOPE = "all"
#: method -> family, in the table's order.
XTAIL_FAMILIES = {
    "finetune": "baseline",
    "zscl": "downstream", "moe_adapters": "downstream", "diki": "downstream", "condu": "downstream",
    "rail": "analytic", "lada": "parameter-efficient",
}
METHODS = ",".join(XTAIL_FAMILIES)
#: Why each method is configured as it is (families.py's reasons for the methods it also compares).
WHY = {
    **{name: families.WHY[name] for name in XTAIL_FAMILIES if name in families.WHY},
    "finetune": "sequential fine-tuning with the class-prompt cross-entropy among the classes seen so far (under "
                "class_scope all the loss scores as in seen), the reference of every verdict",
    "rail": "primal form, ridge 0.1 and fusion weight 0.8 (official), a random hidden layer of `--rail-hidden-dim` "
            "units (official 15000); takes no optimizer step",
    "lada": "the paper's text side (a fresh AdaptFormer on the text tower per task, Appendix B) and the library's "
            "defaults (4 memory units per class, GMM distillation), as recipe lada-mtil-bundled; its own loss "
            "(Eq. 3-4) in place of the cross-entropy, `--lada-lr` (the recipe's 1e-3)",
}
#: Registered methods this table does not compare, and why (a user may still name them in `--methods`).
NOT_COMPARED = {
    "joint, modx, ctp, lwf, c_clip, ewc, si, mas, er, derpp, der, dns, gem, agem, sequential, cumulative_all, "
    "cumulative_exp, cumulative_equal, restart, oracle, patching, lora, prompt, wise_ft, weight_ensemble, magmax":
        "one model scored like finetune's, with nothing that routes, votes or ranks classes without a task id: "
        "their class-scope-free comparison is benchmarks/families.py (task-aware); any of them runs here with "
        "--methods",
    "cllclip, teir, grow_vocab": "the language family (new vocabulary, parallel captions): no class labels to learn",
    "learner_heads": "CMCL's modality-pair family on frozen features: trains pair tasks, not classification",
}
#: The bundled domains in X-TAIL's order (I) and reversed (II).
ORDERS = {"I": tuple(XTAIL_BUNDLED_TASKS), "II": tuple(reversed(XTAIL_BUNDLED_TASKS))}
STREAMS = {STREAM: families.StreamSpec(STREAM, ORDERS, tuple(XTAIL_BUNDLED_TASKS),
                                       lambda keys, **sizes: build_stream(STREAM, tasks=keys, **sizes))}
#: The default sizes, smaller than families.py's (300 / 300). Measured on 2 cores: scoring among every class of the
#: stream (class_scope all) makes a training step ~3 s against ~0.1 s task-aware, and evaluation ~10x slower too, so a
#: run still takes ~50 s (rail) to ~115 s (lada) at these sizes: the default benchmark is ~35 minutes, not 15.
TRAIN_PER_TASK, EVAL_PER_TASK = 128, 100
#: The smoke run's sizes: families.py's (a tiny starting model, a few images per task, one seed, order I).
SMOKE = families.SMOKE


def parser():
    """families.py's options, with this benchmark's stream, methods, orders, seeds and output as defaults."""
    made = families.parser(__doc__, STREAMS, tasks_help=f"comma-separated {STREAM} task keys in the order given "
                                                         f"({', '.join(XTAIL_BUNDLED_TASKS)})")
    made.set_defaults(methods=METHODS, order="I", seeds="0,1,2", train_per_task=TRAIN_PER_TASK,
                      eval_per_task=EVAL_PER_TASK, output=str(Path(__file__).parent / "results" / "xtail"))
    return made


def parse(argv: list[str] | None = None):
    """Parsed options, every value checked (families.parse on this benchmark's streams and defaults)."""
    return families.parse(argv, parser(), STREAMS, SMOKE)


def write(runs: list[dict], refused: dict[tuple, str], failed: dict[tuple, list[str]], start: dict, options,
          command: str) -> None:
    """<output>.md (the protocol, the configurations, the table with chance and majority, the verdicts) and .json."""
    orders = sorted({r["order"] for r in runs}) or options.order
    seeds = sorted({r["seed"] for r in runs}) or options.seeds
    candidates = {b["n_classes"] for b in start["streams"][STREAM]["baselines"]}
    lines = [
        "# The task-agnostic methods on X-TAIL",
        "",
        f"Command: `{command}`  ",
        f"Starting model: `benchmarks/pretrain_start.py` ({start['model']}, {start['recipe']['epochs']:g} epochs; "
        f"control Flickr8k-en test R_mean {start['control']:.1f} on {options.control_examples} images). Stream "
        f"`{STREAM}` (16 training images per class, \"a photo of a {{c}}.\" for every domain), at most "
        f"{options.train_per_task} training images per task, C = the mean task size x {options.epochs:g} epoch(s) "
        f"samples per task in whole batches, batch {options.batch_size}, cosine with 10% warmup, weight decay 0.1, "
        f"lr {options.lr:g} (where the table below says otherwise). **`class_scope: all`**: every eval image "
        f"({options.eval_per_task} stratified per task) is scored among the classes of every task of the stream "
        f"({', '.join(map(str, sorted(candidates)))} candidates), trained or not, with no domain identity. Orders "
        f"{', '.join(orders)}; seeds {', '.join(map(str, seeds))}; mean ± std over (order, seed) pairs.",
        "",
        "Last / Avg. / Transfer as MTIL's (ZSCL's `mtil/results.ipynb`; RAIL computes X-TAIL's the same way) on the "
        "all-class accuracy matrix. Chance: 100 / the candidate classes; majority: the largest class's share of the "
        "task's eval rows. **Transfer (above)**: Transfer over the tasks where the starting model is above the "
        "majority rate by 2 SE. **Plasticity**: mean accuracy right after training each task; **forgetting**: mean "
        "drop from a task's best to its last accuracy. **Control**: Flickr8k-en test retrieval R_mean after the last "
        "task. rail takes no optimizer step, so it has no step time and trains 0 samples (its `trainable` cell counts "
        "the parameters that require a gradient, none of which is updated).",
        "",
        "Configurations:",
        "",
        *families.config_lines(options.methods, options, XTAIL_FAMILIES, WHY),
        "",
        "Not compared here: " + "; ".join(f"{k}: {v}" for k, v in NOT_COMPARED.items()) + ".",
        "",
        *families.stream_table(STREAM, runs, refused, failed, options.methods, start, XTAIL_FAMILIES),
        RUN_COST_NOTE,
        "",
    ]
    results_path(options.output, ".md").write_text("\n".join(lines), encoding="utf-8")
    record = {"command": command, "class_scope": CLASS_SCOPE, "start": start, "runs": runs,
              "refused": [{"stream": s, "method": m, "reason": why} for (s, m), why in refused.items()],
              "failed": [{"stream": s, "method": m, "errors": errors} for (s, m), errors in failed.items()]}
    results_path(options.output, ".json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    options = parse(argv)
    command = "python benchmarks/xtail.py " + " ".join(sys.argv[1:] if argv is None else argv)
    start_model, start, image_size = families.starting_point(options)
    _, failed = families.compare(options, STREAMS, start_model, start, image_size,
                                 lambda runs, refused, failed: write(runs, refused, failed, start, options, command),
                                 class_scope=CLASS_SCOPE)
    print(results_path(options.output, ".md").read_text(encoding="utf-8")[:8000], flush=True)
    families.exit_on_failures(failed)


if __name__ == "__main__":
    main()
