"""hf_ccl's metrics as `evaluate` modules: each loads offline from the installed package, gives exactly the plain
function's numbers (hand-computed cases and a real run's matrix and embeddings), combines, refuses unknown options,
and has a card with its formula and source."""

from __future__ import annotations

import math
import warnings

import evaluate
import numpy as np
import pytest
import torch

import hf_ccl.evaluation.continual_metrics as cm
import hf_ccl.metrics as metrics
from hf_ccl.evaluation import NonFiniteEmbeddingError, NotEvaluatedWarning
from hf_ccl.evaluation.retrieval import recall_at_k
from hf_ccl.evaluation.zeroshot import zero_shot_accuracy

R = [[50.0, 10.0, 20.0], [55.0, 60.0, 30.0], [30.0, 45.0, 69.0]]
B = [5.0, 10.0, 10.0]
SIZES = [2, 1, 1]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def plain(name: str, matrix, initial=None, sizes=None) -> dict[str, float]:
    """What each matrix module must return, from the plain functions."""
    summary = cm.summarize(matrix, initial, sizes)
    keys = {
        "final_average": ["final_average"], "average_incremental": ["average_incremental"],
        "forgetting": ["forgetting"], "backward_transfer": ["backward_transfer"],
        "forward_transfer": ["forward_transfer"], "tic": ["tic_id", "tic_bwt", "tic_fwt", "tic_rel_bwt", "tic_rel_fwt"],
        "mtil": ["mtil_transfer", "mtil_average", "mtil_last"],
        "class_incremental": ["class_incremental_average", "class_incremental_last"],
        "continual_metrics": list(summary),
    }[name]
    return {key: summary[key] for key in keys}


MATRIX_MODULES = [name for name in metrics.METRIC_MODULES if name not in ("recall_at_k", "zero_shot_accuracy")]


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.mark.parametrize("name", MATRIX_MODULES)
def test_matrix_modules_give_the_plain_functions_numbers_by_hand(name):
    module = metrics.load(name)
    result = module.compute(predictions=R, initial=B, sizes=SIZES)
    assert same(result, plain(name, np.array(R), B, SIZES))
    if name == "mtil":  # hand-computed: Transfer (10 + (20 + 30) / 2) / 2, Avg. 369 / 9, Last 48
        assert result == {"mtil_transfer": 17.5, "mtil_average": 41.0, "mtil_last": 48.0}
    if name == "forgetting":
        assert result == {"forgetting": 20.0}
    nan = [row[:] for row in R]
    nan[2][0] = float("nan")  # not evaluated: the keys that read it are NaN, with one warning naming the cell
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = module.compute(predictions=nan, initial=B, sizes=SIZES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEvaluatedWarning)
        assert same(result, plain(name, np.array(nan), B, SIZES))
    named = [str(w.message) for w in caught if w.category is NotEvaluatedWarning]
    nan_keys = ", ".join(key for key, value in result.items() if math.isnan(value))
    assert named == ([f"{nan_keys} {'is NaN: it reads' if ',' not in nan_keys else 'are NaN: they read'} cells "
                      "marked not evaluated (NaN): R[2, 0]"] if nan_keys else [])


def test_options_a_module_needs_or_does_not_know_are_refused():
    with pytest.raises(ValueError, match="needs initial"):
        metrics.load("forward_transfer").compute(predictions=R)
    with pytest.raises(ValueError, match="needs sizes"):
        metrics.load("class_incremental").compute(predictions=R)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['initail'\]"):
        metrics.load("mtil").compute(predictions=R, initail=B)
    with pytest.raises(ValueError, match="Unknown hf_ccl metric"):
        metrics.path("accuracy")


def test_combine_runs_each_module_on_the_same_matrix():
    combined = evaluate.combine([metrics.load("mtil"), metrics.load("forgetting"), metrics.load("forward_transfer")])
    result = combined.compute(predictions=R, initial=B)
    assert same(result, {**plain("mtil", np.array(R)), **plain("forgetting", np.array(R)),
                         **plain("forward_transfer", np.array(R), B)})


def test_embedding_modules_give_the_plain_functions_numbers():
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(6, 8, generator=generator)
    captions = torch.randn(10, 8, generator=generator)
    owners = torch.tensor([0, 0, 1, 2, 2, 3, 4, 4, 5, 5])
    text_ids = torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 7, 8])  # captions 3 and 4 are the same text
    recall = metrics.load("recall_at_k").compute(predictions=captions.tolist(), references=owners.tolist(),
                                                 image_embeds=images.tolist(), ks=[1, 2], text_ids=text_ids.tolist())
    assert recall == recall_at_k(images, captions, owners, ks=(1, 2), text_ids=text_ids)
    classes = torch.randn(7, 8, generator=generator)
    labels = torch.tensor([0, 6, 3, 3, 1, 2])
    accuracy = metrics.load("zero_shot_accuracy").compute(predictions=images.tolist(), references=labels.tolist(),
                                                          class_embeds=classes.tolist(), ks=[1, 5])
    assert accuracy == zero_shot_accuracy(images, labels, classes, ks=(1, 5))
    with pytest.raises(ValueError, match="needs class_embeds"):
        metrics.load("zero_shot_accuracy").compute(predictions=images.tolist(), references=labels.tolist())


def test_the_modules_reproduce_a_real_runs_results(tmp_path, clip_tokenizer):
    """A 2-task digits run: `continual_metrics` on its matrix equals results.json's summary; `zero_shot_accuracy` on
    its model's embeddings equals the evaluator's accuracy; `recall_at_k` on Flickr8k captions equals the plain
    function's."""
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream
    from hf_ccl.evaluation import ResultsMatrix
    from hf_ccl.evaluation.encode import encode_images, encode_texts
    from hf_ccl.evaluation.zeroshot import zero_shot_classifier
    from hf_ccl.families import default_image_processor
    from hf_ccl.methods import build_methods
    from hf_ccl.testing import tiny_model

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=24)
    stream.tasks = stream.tasks[:2]
    model = tiny_model()
    processor = default_image_processor(model)
    args = ContinualArguments(output_dir=str(tmp_path), progress=False,
                              training={"max_steps": 2, "per_device_train_batch_size": 16})
    ContinualLearner(model, stream, build_methods(["finetune"]), processor, clip_tokenizer, args).fit()
    results = ResultsMatrix.load(tmp_path)
    summary = metrics.load("continual_metrics").compute(predictions=results.headline().tolist(),
                                                        initial=results.initial_headline().tolist())
    assert same(summary, results.summary())
    matrix, initial = results.headline(), results.initial_headline()
    sizes = results.eval_sizes()
    for name in MATRIX_MODULES:  # every matrix module on the run's matrix, as the plain functions
        module = metrics.load(name).compute(predictions=matrix.tolist(), initial=initial.tolist(), sizes=sizes)
        assert same(module, plain(name, matrix, initial, sizes)), name

    task = stream[1]
    images = encode_images(model, processor, list(task.eval["image"]))
    classes = zero_shot_classifier(model, task.class_names, task.eval_templates, clip_tokenizer)
    module = metrics.load("zero_shot_accuracy").compute(predictions=images.tolist(), references=task.eval["label"],
                                                        class_embeds=classes.tolist())
    assert module["accuracy"] == results.rows[-1].metrics[task.name]["accuracy"]

    flickr = build_stream("flickr8k-random5", max_train_per_task=4, max_eval_per_task=12)[0].eval
    captions = [text for texts in flickr["texts"] for text in texts]
    owners = [i for i, texts in enumerate(flickr["texts"]) for _ in texts]
    image_embeds = encode_images(model, processor, list(flickr["image"]))
    text_embeds = encode_texts(model, clip_tokenizer, captions)
    module = metrics.load("recall_at_k").compute(predictions=text_embeds.tolist(), references=owners,
                                                 image_embeds=image_embeds.tolist())
    assert module == recall_at_k(image_embeds, text_embeds, torch.tensor(owners))


@pytest.mark.parametrize("name", metrics.METRIC_MODULES)
def test_every_module_has_a_card_with_its_formula_and_source(name):
    text = (metrics.ROOT / name / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\ntitle: " + name)
    assert "## Formula" in text and ("## Source" in text or "| source |" in text) and "## How to use" in text
    module = metrics.load(name)
    assert module.name == name  # evaluate names a module after its class ("TiC" loaded as "ti_c")
    assert module.info.description and module.info.inputs_description


# ----- bad values (issue 25, item 11) -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MATRIX_MODULES)
def test_matrix_modules_refuse_infinite_out_of_range_and_fraction_scores(name):
    module = metrics.load(name)
    infinite = [row[:] for row in R]
    infinite[1][0] = -math.inf
    with pytest.raises(ValueError, match=r"finite.*R\[1, 0\] = -inf"):
        module.compute(predictions=infinite, initial=B, sizes=SIZES)
    with pytest.raises(ValueError, match=r"\[0, 100\].*b\[2\] = 101"):
        module.compute(predictions=R, initial=[5.0, 10.0, 101.0], sizes=SIZES)
    fractions = (np.array(R) / 100).tolist()
    with pytest.raises(ValueError, match=r"every score lies in \[0, 1\].*scale='fraction'"):
        module.compute(predictions=fractions, initial=(np.array(B) / 100).tolist(), sizes=SIZES)
    result = module.compute(predictions=fractions, initial=(np.array(B) / 100).tolist(), sizes=SIZES, scale="fraction")
    expected = plain(name, np.array(R), B, SIZES)
    assert result.keys() == expected.keys() and all(result[k] == pytest.approx(expected[k] / 100) for k in result)


def test_embedding_modules_refuse_non_finite_embeddings():
    """A NaN image embedding scored 25 % (its comparisons all false), an infinite caption embedding some recall."""
    generator = torch.Generator().manual_seed(0)
    images, classes = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
    images[2, 3] = math.nan
    accuracy = metrics.load("zero_shot_accuracy")
    with pytest.raises(NonFiniteEmbeddingError, match=r"image_embeds: 1 of 4 rows hold NaN or infinite values "
                                                      r"\(row 2\)"):
        accuracy.compute(predictions=images.tolist(), references=[0, 1, 2, 3], class_embeds=classes.tolist())
    with pytest.raises(NonFiniteEmbeddingError, match=r"image_embeds: 1 of 4 rows.*row 2"):
        zero_shot_accuracy(images, torch.arange(4), classes)
    with pytest.raises(NonFiniteEmbeddingError, match=r"class_embeds: 4 of 4 rows"):
        zero_shot_accuracy(classes, torch.arange(4), torch.full((4, 8), math.nan))
    captions = torch.randn(4, 8, generator=generator)
    captions[0, 0] = math.inf
    with pytest.raises(NonFiniteEmbeddingError, match=r"text_embeds: 1 of 4 rows.*row 0"):
        metrics.load("recall_at_k").compute(predictions=captions.tolist(), references=[0, 1, 2, 3],
                                            image_embeds=classes.tolist())
