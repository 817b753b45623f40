"""Evaluation that stays a small part of a run: reused embeddings (never stale), eval_every, a fixed eval subsample,
and image embedding in bounded memory."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from datasets import Dataset, Features, Image, List, Value, load_dataset

from hf_ccl import paths
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
from hf_ccl.data.task import Task, TaskStream
from hf_ccl.evaluation import ResultsMatrix, evaluate_stream, evaluate_task
from hf_ccl.evaluation.cache import EmbeddingCache
from hf_ccl.evaluation.schedule import StreamEvaluator, eval_rows, evaluated_after
from hf_ccl.methods import build_methods
from hf_ccl.testing import StopAfterTask, tiny_clip
from hf_ccl.validation import ConfigError

FEATURES = Features({"image": Image(decode=False), "texts": List(Value("string")), "image_id": Value("string"),
                     "label": Value("int64")})


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    """A retrieval task (6 Flickr8k test images, 5 captions each) and two classification tasks of digits."""
    rows = load_dataset(str(paths.data_root() / "flickr8k"), split="test")
    rows = rows.cast_column("image", Image(decode=False)).select(range(6))
    flickr = Dataset.from_dict({"image": rows["image"], "texts": [list(t) for t in rows["en"]],
                                "image_id": [f"f/{i}" for i in range(6)], "label": [-1] * 6}, features=FEATURES)
    digits = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    return [Task("flickr", flickr, flickr, kind="retrieval"), *digits.tasks[:2]]


@pytest.fixture(scope="module")
def processor():
    return load_image_processor(32)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _evaluate(model, tasks, processor, tokenizer, cache=None, **kwargs):
    return evaluate_stream(model, tasks, processor, tokenizer, batch_size=8, cache=cache, **kwargs)


def _counts(cache: EmbeddingCache, run) -> tuple[int, int]:  # noqa: ANN001
    hits, misses = cache.hits, cache.misses
    run()
    return cache.hits - hits, cache.misses - misses


def _text_step(model: torch.nn.Module, tokenizer) -> None:  # noqa: ANN001
    """One SGD step on the text tower only (the vision tower frozen, as with a text-only LoRA)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(("text_model.", "text_projection")))
    tokens = tokenizer(["a photo of a dog.", "a cat"], padding=True, return_tensors="pt")
    loss = model.get_text_features(**tokens).pooler_output.pow(2).mean()
    loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    model.zero_grad()


# ---------------------------------------------------------------- reuse, and never a stale embedding


def test_unchanged_and_frozen_towers_are_reused_with_identical_metrics(tasks, processor, tokenizer):
    model, cache = tiny_clip(seed=0), EmbeddingCache()
    first = _evaluate(model, tasks, processor, tokenizer, cache)
    assert (cache.hits, cache.misses) == (0, 6)  # images and texts (or class embeddings) of 3 tasks
    assert _counts(cache, lambda: _evaluate(model, tasks, processor, tokenizer, cache)) == (6, 0)
    assert _evaluate(model, tasks, processor, tokenizer, cache) == first == _evaluate(model, tasks, processor,
                                                                                       tokenizer)
    _text_step(model, tokenizer)  # the vision tower stays frozen: its embeddings are reused
    results = {}
    assert _counts(cache, lambda: results.update(_evaluate(model, tasks, processor, tokenizer, cache))) == (3, 3)
    assert results == _evaluate(model, tasks, processor, tokenizer)  # exactly what recomputing gives
    assert results != first


def _optimizer_step(model, tokenizer, processor):  # noqa: ANN001, ARG001
    model.requires_grad_(True)
    pixels = processor(images=[np.zeros((32, 32, 3), dtype=np.uint8)], return_tensors="pt")["pixel_values"]
    tokens = tokenizer(["a photo"], return_tensors="pt")
    (model.get_image_features(pixel_values=pixels).pooler_output.sum()
     + model.get_text_features(**tokens).pooler_output.sum()).backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    return model, tokenizer, processor


def _load_state_dict(model, tokenizer, processor):  # noqa: ANN001
    model.load_state_dict(tiny_clip(seed=1).state_dict())
    return model, tokenizer, processor


def _data_swap(model, tokenizer, processor):  # noqa: ANN001
    for parameter in model.parameters():
        parameter.data = parameter.data * 1.01
    return model, tokenizer, processor


def _in_place_data_edit(model, tokenizer, processor):  # noqa: ANN001
    for parameter in model.parameters():
        version = parameter._version
        parameter.data.mul_(1.01)
        assert parameter._version == version  # no version counter sees this edit: the weights' bytes do
    return model, tokenizer, processor


def _replaced_model(model, tokenizer, processor):  # noqa: ANN001, ARG001
    return tiny_clip(seed=0), tokenizer, processor  # the same weights, another object: not trusted


def _grown_vocabulary(model, tokenizer, processor):  # noqa: ANN001
    tokenizer.add_tokens(["digitword"])  # in place: the same object, one more token (unused by the eval texts)
    return model, tokenizer, processor


def _other_processor(model, tokenizer, processor):  # noqa: ANN001, ARG001
    other = load_image_processor(32)
    other.image_mean = [0.5, 0.5, 0.5]
    return model, tokenizer, other


CHANGES = {  # change -> (image entries recomputed, text entries recomputed), of 3 each
    "optimizer_step": (_optimizer_step, 3, 3),
    "load_state_dict": (_load_state_dict, 3, 3),
    "param_data_swap": (_data_swap, 3, 3),
    "in_place_data_edit": (_in_place_data_edit, 3, 3),
    "replaced_model": (_replaced_model, 3, 3),
    "grown_vocabulary": (_grown_vocabulary, 0, 3),
    "other_image_processor": (_other_processor, 3, 0),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_any_change_of_what_produced_an_embedding_recomputes_it(tasks, processor, tokenizer, change):
    model, cache = tiny_clip(seed=0), EmbeddingCache()
    tokenizer = load_tokenizer() if change == "grown_vocabulary" else tokenizer  # not the module's, it is changed
    _evaluate(model, tasks, processor, tokenizer, cache)
    apply, images, texts = CHANGES[change]
    model, changed_tokenizer, changed_processor = apply(model, tokenizer, processor)
    results = {}
    hits, misses = _counts(cache, lambda: results.update(
        _evaluate(model, tasks, changed_processor, changed_tokenizer, cache)))
    assert (hits, misses) == (6 - images - texts, images + texts)
    assert results == _evaluate(model, tasks, changed_processor, changed_tokenizer)


def test_other_settings_and_rows_recompute(tasks, processor, tokenizer):
    model, cache = tiny_clip(seed=0), EmbeddingCache()
    _evaluate(model, tasks, processor, tokenizer, cache)
    assert _counts(cache, lambda: _evaluate(model, tasks, processor, tokenizer, cache, max_length=8)) == (3, 3)
    assert _counts(cache, lambda: evaluate_stream(model, tasks, processor, tokenizer, batch_size=4, cache=cache,
                                                  max_length=8)) == (0, 6)
    fewer = [dataclasses.replace(task, eval=task.eval.select(range(4))) for task in tasks]
    assert _counts(cache, lambda: evaluate_stream(model, fewer, processor, tokenizer, batch_size=4, cache=cache,
                                                  max_length=8)) == (0, 6)


# ---------------------------------------------------------------- eval_every and a fixed subsample


def test_options_are_checked():
    for values, message in (({"evaluation": {"every": 0}}, "evaluation.every must be >= 1"),
                            ({"evaluation": {"max_examples": 0}}, "evaluation.max_examples must be >= 1"),
                            ({"evaluation": {"every": "often"}}, "evaluation.every must be an integer"),
                            ({"evaluation": {"cache": "yes"}}, "evaluation.cache must be true or false")):
        with pytest.raises(ConfigError, match=message):
            ContinualArguments(output_dir="x", **values)
    assert [evaluated_after(i, 5, 2) for i in range(5)] == [False, True, False, True, True]
    assert [evaluated_after(i, 3, 1) for i in range(3)] == [True, True, True]


def _full() -> np.ndarray:
    return np.array([[50.0, 20.0, 10.0], [40.0, 60.0, 15.0], [35.0, 45.0, 70.0]])


def _matrix(missing: set[int]) -> ResultsMatrix:
    matrix = ResultsMatrix(["a", "b", "c"], "accuracy")
    matrix.add_row("initial", {name: {"accuracy": 5.0 + i} for i, name in enumerate("abc")})
    for i, name in enumerate("abc"):
        if i in missing:
            matrix.add_row(name, {}, evaluated=False)
        else:
            matrix.add_row(name, {task: {"accuracy": _full()[i, j]} for j, task in enumerate("abc")})
    return matrix


#: The rows of a 3 x 3 matrix that each derived metric reads (by its definition, `continual_metrics`).
READS = {
    "final_average": {2}, "initial_average": set(), "average_incremental": {0, 1, 2}, "forgetting": {0, 1, 2},
    "backward_transfer": {0, 1, 2}, "forward_transfer": {0, 1}, "tic_id": {0, 1, 2}, "tic_bwt": {1, 2},
    "tic_fwt": {0, 1}, "tic_rel_bwt": {1, 2}, "tic_rel_fwt": {0, 1},
    "mtil_transfer": {0, 1}, "mtil_average": {0, 1, 2}, "mtil_last": {2},
}


@pytest.mark.parametrize("missing", [0, 1])
def test_rows_not_evaluated_are_marked_and_each_derived_metric_that_needs_them_is_null(tmp_path, missing):
    full, partial = _matrix(set()).summary(), _matrix({missing}).summary()
    assert sorted(READS) == sorted(full)
    for name, rows in READS.items():  # null exactly when the metric reads a cell of the missing row
        if missing in rows:
            assert math.isfinite(full[name]) and math.isnan(partial[name]), name
        else:
            assert partial[name] == pytest.approx(full[name]), name
    matrix = _matrix({missing})
    matrix.save(tmp_path)
    loaded = ResultsMatrix.load(tmp_path)
    assert [row.evaluated for row in loaded.rows] == [i != missing for i in range(3)]
    assert np.isnan(loaded.headline()[missing]).all()
    text = (tmp_path / "results.md").read_text()
    assert f"after {'abc'[missing]} (not evaluated)" in text and "Not evaluated after" in text
    with pytest.raises(ValueError, match="holds no metrics"):
        matrix.add_row("c", {"a": {"accuracy": 1.0}}, evaluated=False)


def test_a_fixed_subsample_is_the_same_rows_every_time_and_recorded(tasks, processor, tokenizer):
    evaluator = StreamEvaluator(max_examples=5, seed=3)
    first = evaluator.task(tasks[1])
    assert len(first.eval) == 5 and evaluator.task(tasks[1]) is first
    assert first.eval["image_id"] == tasks[1].eval.select(eval_rows(8, 5, 3, tasks[1].name))["image_id"]
    assert eval_rows(8, 5, 4, tasks[1].name).tolist() != eval_rows(8, 5, 3, tasks[1].name).tolist()
    model = tiny_clip(seed=0)
    metrics = evaluator.evaluate(model, tasks, processor, tokenizer, batch_size=8, max_length=None)
    assert metrics[tasks[1].name] == evaluate_task(model, first, processor, tokenizer, batch_size=8)
    matrix = ResultsMatrix.from_tasks(tasks)
    evaluator.record(matrix, tasks)
    assert matrix.evaluation["examples"]["flickr"] == {"rows": 6, "evaluated": 5}
    matrix.add_row("initial", metrics)
    assert "fixed seeded subsample of at most 5 eval rows" in matrix.to_markdown()
    for other in (StreamEvaluator(max_examples=6, seed=3), StreamEvaluator(seed=3), StreamEvaluator(max_examples=5)):
        with pytest.raises(ValueError, match="would not be comparable"):
            other.record(ResultsMatrix.from_dict(matrix.to_dict()), tasks)
    StreamEvaluator(max_examples=5, seed=3, eval_every=2).record(matrix, tasks)  # eval_every may change


def _learner(output_dir, stream, resume=False, callbacks=(), **options):  # noqa: ANN001, ANN003
    args = ContinualArguments(output_dir=str(output_dir), progress=False, seed=3,
                              training={"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3},
                              resume_from_checkpoint=True if resume else None, **options)
    return ContinualLearner(tiny_clip(seed=3), stream, build_methods(["finetune"]), load_image_processor(32),
                            load_tokenizer(), args, task_callbacks=list(callbacks))


def _two_tasks() -> TaskStream:
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=12)
    return TaskStream(stream.name, stream.tasks[:2])


OPTIONS = {"evaluation": {"every": 2, "max_examples": 8}}


def test_eval_every_in_a_run_marks_the_rows_it_skips(tmp_path):
    learner = _learner(tmp_path, _two_tasks(), save_checkpoints=False, **OPTIONS)
    calls = []
    evaluate = learner.evaluate
    learner.evaluate = lambda **kwargs: calls.append(1) or evaluate(**kwargs)
    results = learner.fit()
    assert len(calls) == 2  # the initial row and the last task's
    assert [row.evaluated for row in results.rows] == [False, True]
    assert results.evaluation["eval_every"] == 2 and results.evaluation["eval_max_examples"] == 8
    assert math.isfinite(results.summary()["final_average"]) and math.isnan(results.summary()["forgetting"])
    assert "(not evaluated)" in results.to_markdown() and "subsample of at most 8" in results.to_markdown()


@pytest.mark.slow  # three short runs: ~50 s on 2 loaded cores
def test_a_resumed_run_with_eval_every_gives_the_same_matrix(tmp_path):
    stream, options = _two_tasks(), OPTIONS
    expected = _learner(tmp_path / "whole", stream, **options).fit()
    _learner(tmp_path / "resumed", stream, callbacks=[StopAfterTask(0)], **options).fit()
    resumed = _learner(tmp_path / "resumed", stream, resume=True, **options).fit()
    assert resumed.to_dict()["rows"] == expected.to_dict()["rows"]
    other = _learner(tmp_path / "resumed", stream, resume=True, evaluation={"every": 2})  # all eval rows this time
    with pytest.raises(ConfigError, match=r"evaluation.max_examples: 8 -> '<not set>'"):  # before anything is trained
        other.fit()
    other = _learner(tmp_path / "resumed", stream, resume=True, evaluation={"every": 2},
                     resume_allow_changes=["evaluation.max_examples"])
    other.restore(tmp_path / "resumed" / "task-1")
    with pytest.raises(ValueError, match="would not be comparable"):  # and allowing it cannot mix the rows
        other.evaluate()


# ---------------------------------------------------------------- bounded memory


def test_eval_images_are_decoded_and_embedded_one_batch_at_a_time(tasks, processor, tokenizer, monkeypatch):
    """Never more than one batch of decoded images ahead of the model, whatever the size of the eval split."""
    import hf_ccl.evaluation.encode as encode

    decoded: list[int] = []
    real_decode = encode.decode_image
    monkeypatch.setattr(encode, "decode_image", lambda value, where: decoded.append(1) or real_decode(value, where))
    model = tiny_clip(seed=0)
    real_features = model.get_image_features
    seen: list[tuple[int, int]] = []

    def features(pixel_values):  # noqa: ANN001, ANN202
        seen.append((len(decoded), pixel_values.shape[0]))
        return real_features(pixel_values=pixel_values)

    model.get_image_features = features
    big = dataclasses.replace(tasks[0], eval=tasks[0].eval.select([i % 6 for i in range(40)]))
    evaluate_task(model, big, processor, tokenizer, batch_size=6)
    assert seen == [(6, 6), (12, 6), (18, 6), (24, 6), (30, 6), (36, 6), (40, 4)]  # (decoded so far, batch)
