"""benchmarks/xtail.py, the task-agnostic methods on X-TAIL: which methods it compares (and why not the others), their
options, X-TAIL's chance rate, and its smoke run end to end on 2 tiny tasks (every method, class_scope all)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from hf_ccl.data import build_stream
from hf_ccl.methods import build_methods
from hf_ccl.methods.registry import available_methods

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import families  # noqa: E402  (benchmarks/ is not a package)
import xtail  # noqa: E402

#: The registered methods that rank, route or vote among classes without a task id: X-TAIL is their protocol.
TASK_AGNOSTIC = {"rail", "lada", "diki", "condu", "moe_adapters"}
SMOKE_TASKS = ["dtd10", "rsscn7"]


def test_every_registered_method_is_compared_or_listed_with_a_reason():
    listed = {name for key in xtail.NOT_COMPARED for name in key.split(", ")}
    assert not listed & set(xtail.XTAIL_FAMILIES)
    assert set(available_methods()) == set(xtail.XTAIL_FAMILIES) | listed
    assert TASK_AGNOSTIC <= set(xtail.XTAIL_FAMILIES) and "finetune" in xtail.XTAIL_FAMILIES
    assert set(xtail.WHY) == set(xtail.XTAIL_FAMILIES) and all(xtail.NOT_COMPARED.values())
    # families.py no longer says rail and lada are not run anywhere
    assert all("benchmarks/xtail.py" in families.NOT_COMPARED[name] for name in ("rail", "lada"))


def test_every_compared_method_builds_with_its_configuration(tmp_path):
    options = xtail.parse(["--runs-dir", str(tmp_path), "--rail-hidden-dim", "64", "--lada-lr", "0.01"])
    assert (options.streams, options.order, options.seeds) == (["xtail-bundled"], ["I"], [0, 1, 2])
    assert (options.train_per_task, options.eval_per_task) == (xtail.TRAIN_PER_TASK, xtail.EVAL_PER_TASK)
    assert options.methods == list(xtail.XTAIL_FAMILIES)
    for name in options.methods:
        (method,) = build_methods([name], families.family_args(name, options))
        assert method.name == name
    assert families.family_args("rail", options) == {"rail": {"hidden_dim": 64}}
    assert families.family_args("lada", options) == {"lada": {"text_tuning": "adaptformer"}}  # the paper's text side
    assert families.learning_rate("lada", options) == 0.01
    assert [families.classification_loss(n) for n in ("finetune", "rail", "lada")] == [
        "cross_entropy", "cross_entropy", "contrastive"]  # lada's own terms replace the loss


def test_a_stream_other_than_xtail_bundled_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        xtail.parse(["--streams", "pacs-domains", "--runs-dir", str(tmp_path)])
    assert stopped.value.code == 2 and "unknown ['pacs-domains']" in capsys.readouterr().err


def test_chance_is_over_every_candidate_class_and_majority_the_largest_share():
    stream = build_stream("xtail-bundled", tasks=SMOKE_TASKS, max_train_per_task=1, max_eval_per_task=16)
    union = {name for task in stream for name in task.class_names}
    for task in stream:
        b = families.scope_baseline(task, stream, "all")
        labels = task.eval.with_format("arrow")["label"].to_pylist()
        assert (b.n_classes, b.chance) == (len(union), 100 / len(union))  # 10 + 7 names: 100 / 17
        assert b.majority == 100 * max(Counter(labels).values()) / len(labels)
        assert families.scope_baseline(task, stream).n_classes == len(task.class_names)  # task scope: its own


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of every method on two tiny tasks, in-process (the script's main)."""
    folder = tmp_path_factory.mktemp("xtail")
    argv = ["--smoke", "--tasks", ",".join(SMOKE_TASKS), "--start-cache", str(folder / "cache"),
            "--runs-dir", str(folder / "runs"), "--output", str(folder / "out" / "xtail")]
    xtail.main(argv)
    return argv, (folder / "out" / "xtail.md").read_text(), json.loads((folder / "out" / "xtail.json").read_text())


def test_the_smoke_run_compares_every_method_under_class_scope_all(smoke):
    argv, table, record = smoke
    assert f"Command: `python benchmarks/xtail.py {' '.join(argv)}`" in table
    assert record["class_scope"] == "all" and not record["failed"] and not record["refused"]
    assert sorted({r["method"] for r in record["runs"]}) == sorted(xtail.XTAIL_FAMILIES)
    for method in xtail.XTAIL_FAMILIES:
        row = next(line for line in table.splitlines() if line.startswith(f"| {method} | "))
        assert "failed" not in row and "cannot run" not in row
    baselines = record["start"]["streams"]["xtail-bundled"]["baselines"]
    assert [b["n_classes"] for b in baselines] == [17, 17]  # every class of both tasks, not the task's own
    assert "| dtd10 | 17 | 16 | 5.9 |" in table
    for run in record["runs"]:  # the learner's initial row scores as the table's starting-model row: among all 17
        assert run["initial"] == pytest.approx([b["score"] for b in baselines])
    rail = next(r for r in record["runs"] if r["method"] == "rail")
    assert rail["cost"]["samples"] == 0 and "| rail | analytic |" in table  # trains nothing, still in the table
