"""Task kinds as registered objects (`hf_ccl.data.kinds`): a kind registered here is batched, scored and headlined
by the loop and the evaluator through its own methods; the registry refuses duplicates and unknown kinds in one
line; a method declares the model part it attaches (no role named by a string); no code compares kind names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset

import hf_ccl
from hf_ccl import register_task_kind
from hf_ccl.continual import ContinualArguments, ContinualLearner, check_pair_stream
from hf_ccl.data import Task, TaskStream, build_stream, load_image_processor
from hf_ccl.data.kinds import (
    CollatorSetup,
    EvalSetup,
    ModelPart,
    RetrievalKind,
    TaskKind,
    get_task_kind,
    unregister_task_kind,
)
from hf_ccl.evaluation.evaluator import evaluate_task
from hf_ccl.methods import ContinualMethod, build_methods
from hf_ccl.testing import tiny_clip
from hf_ccl.validation import ConfigError

TOY = "toy-captions"


class CountingKind(RetrievalKind):
    """Captioned tasks scored by image-to-text R@1 alone, counting what the loop asks of it."""

    name = TOY
    description = "toy retrieval"
    headline_metric = "toy_R@1"
    calls: dict[str, int] = {}

    def collators(self, task: Task, setup: CollatorSetup) -> tuple[Any, Any]:
        self.calls["collators"] = self.calls.get("collators", 0) + 1
        return super().collators(task, setup)

    def evaluate(self, model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
        self.calls["evaluate"] = self.calls.get("evaluate", 0) + 1
        return {"toy_R@1": super().evaluate(model, task, setup)["i2t_R@1"]}


@pytest.fixture
def toy_kind():
    register_task_kind(CountingKind)
    kind = get_task_kind(TOY)
    kind.calls.clear()
    yield kind
    unregister_task_kind(TOY)


def test_registry_refuses_duplicates_and_unknown_kinds():
    rows = Dataset.from_dict({"image": [None], "texts": [["a"]], "image_id": ["0"], "label": [-1]})
    with pytest.raises(ConfigError) as refused:
        Task("x", rows, rows, kind="toy-nope")
    assert str(refused.value) == ("Task 'x': unknown task kind 'toy-nope'; valid kinds: classification, pair, "
                                  "retrieval (a new one is registered with hf_ccl.data.register_task_kind)")

    class Twin(RetrievalKind):
        name = "retrieval"

    with pytest.raises(ValueError, match=r"^A task kind named 'retrieval' is already registered \(RetrievalKind\)$"):
        register_task_kind(Twin)
    assert type(get_task_kind("retrieval")) is RetrievalKind
    register_task_kind(RetrievalKind)  # the same class again (a module reloaded) is no conflict

    class Nameless(TaskKind):
        pass

    with pytest.raises(ValueError, match="needs a `name` and a `headline_metric`"):
        register_task_kind(Nameless)


def test_kinds_own_their_checks():
    rows = Dataset.from_dict({"image": [None], "texts": [["a"]], "image_id": ["0"], "label": [-1]})
    with pytest.raises(ValueError, match="a classification task needs class_names"):
        Task("x", rows, rows, kind="classification")
    with pytest.raises(ValueError, match="kind 'retrieval' takes no modalities"):
        Task("x", rows, rows, modalities=("a", "b"))
    pair = Task("p", rows, rows, kind="pair", modalities=("en", "de"))
    assert pair.required_columns == ("en", "de") and pair.headline_metric == "R@1"
    assert pair.kind_spec.trains is ModelPart.LEARNER_HEADS and not pair.kind_spec.has_images
    classes = get_task_kind("classification")
    assert classes.headline("seen") == "seen_accuracy" and classes.headline("task") == "accuracy"
    assert get_task_kind("retrieval").headline("seen") == "R_mean"


def test_a_registered_kind_is_batched_scored_and_headlined_by_the_loop(toy_kind, tmp_path, clip_tokenizer):
    digits = build_stream("digits", max_train_per_task=16, max_eval_per_task=16)[0]
    task = Task("digits-as-captions", digits.train, digits.eval, kind=TOY, source=digits.source)
    assert task.headline_metric == "toy_R@1" and task.kind_spec is toy_kind
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, save_checkpoints=False,
                              training={"max_steps": 1, "per_device_train_batch_size": 8, "warmup_steps": 0})
    learner = ContinualLearner(tiny_clip(seed=0), TaskStream("toy", [task]), build_methods(["finetune"]),
                               load_image_processor(32), clip_tokenizer, args)
    results = learner.fit()
    assert toy_kind.calls["collators"] == 1 and toy_kind.calls["evaluate"] >= 1
    assert results.headline_metrics == ["toy_R@1"]
    scored = evaluate_task(learner.model, task, learner.image_processor, clip_tokenizer)
    assert set(scored) == {"toy_R@1"} and results.headline()[0, 0] == pytest.approx(scored["toy_R@1"])


class AttachingHeads(ContinualMethod):
    """Not the `learner_heads` method, but it declares that it attaches learner heads."""

    name = "toy_heads"
    trains_pair_tasks = True
    attaches = ModelPart.LEARNER_HEADS


def test_a_pair_stream_asks_what_a_method_attaches_not_its_role_name(tmp_path):
    rows = Dataset.from_dict({"en": ["a", "b"], "de": ["c", "d"]})
    stream = TaskStream("pairs", [Task("en-de", rows, rows, kind="pair", modalities=("en", "de"))])
    args = ContinualArguments(output_dir=str(tmp_path))
    check_pair_stream(stream, [AttachingHeads()], args)

    class NoHeads(AttachingHeads):
        attaches = None

    with pytest.raises(ConfigError, match="add the learner_heads method"):
        check_pair_stream(stream, [NoHeads()], args)


def test_no_code_compares_kind_names_or_role_names():
    package = Path(hf_ccl.__file__).parent
    compares = re.compile(r"""\.kind\s*(==|!=)\s*["']|\.kind\s+(not\s+)?in\s*[(\[{"']|\(["']kind["']\)\s*(==|!=)"""
                          r"""|["']\s+in\s+\S+\.roles\b""")
    found = [f"{path.relative_to(package)}:{number}: {line.strip()}"
             for path in sorted(package.rglob("*.py")) if path.name != "kinds.py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if compares.search(line)]
    assert found == []
