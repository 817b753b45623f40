"""The `flickr8k-languages` stream (one language per task, CLL-CLIP's setting, specs/cllclip.md §1) and a 2-language
run with `grow_vocab`: the grown tokenizer and embedding are used for training, evaluation and every checkpoint, and
the task-1 checkpoint is a plain CLIP + tokenizer giving the learner's embeddings; a resumed run reloads them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from datasets import load_dataset
from transformers import AutoTokenizer, CLIPModel

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.data.languages import FLICKR8K_LANGUAGES, rows_with_captions
from hf_ccl.methods import TaskContext, build_methods
from hf_ccl.testing import tiny_clip


def _row(image_id: str) -> int:
    return int(image_id.rsplit("/", 1)[1])


@pytest.fixture(scope="module")
def flickr(shared_data_root):
    folder = str(shared_data_root / "flickr8k")
    return {split: load_dataset(folder, split=split) for split in ("train", "validation", "test")}


def test_eval_images_have_captions_in_every_language(flickr):
    stream = build_stream("flickr8k-languages", max_train_per_task=12, max_eval_per_task=20, seed=3)
    assert stream.task_names == list(FLICKR8K_LANGUAGES)
    eval_ids = stream[0].eval["image_id"]
    assert len(eval_ids) == 20 and all(i.startswith("flickr8k/validation/") for i in eval_ids)  # ug/mn/bo: no test
    validation = flickr["validation"]
    for task in stream:
        assert task.kind == "retrieval" and task.eval["image_id"] == eval_ids  # one image set for every language
        assert len(task.train) == 12 and {"texts", "texts_en"} <= set(task.train.column_names)
        for image_id, texts in zip(task.eval["image_id"], task.eval["texts"], strict=True):
            row = validation[_row(image_id)]
            assert all(row[language] for language in FLICKR8K_LANGUAGES)
            assert texts == [t.strip() for t in row[task.name]]
        for image_id, texts, english in zip(task.train["image_id"], task.train["texts"], task.train["texts_en"],
                                            strict=True):
            row = flickr["train"][_row(image_id)]
            assert image_id.startswith("flickr8k/train/") and texts == [t.strip() for t in row[task.name]]
            assert english == [t.strip() for t in row["en"]]
    # counts on the whole bundled data: images captioned in every language
    assert len(rows_with_captions(validation, FLICKR8K_LANGUAGES)) == 934
    assert len(rows_with_captions(flickr["test"], ["en", "de", "fr", "cs", "zh"])) == 929
    five = build_stream("flickr8k-languages", languages=("zh", "en", "de"), max_train_per_task=4, max_eval_per_task=5)
    assert five.task_names == ["zh", "en", "de"] and five[0].eval[0]["image_id"].startswith("flickr8k/test/")
    with pytest.raises(ValueError, match="Unknown Flickr8k language"):
        build_stream("flickr8k-languages", languages=("en", "xx"))


@pytest.mark.parametrize("init", ["teir", "hf", "fixed"])
def test_grow_vocab_hook(init, clip_tokenizer, tmp_path):
    """on_task_start: new tokenizer and ids in the context, old rows and the embedding's requires_grad kept, new rows by
    the chosen rule (TEIR: scalar mean/std of the whole previous table, spec §3.1)."""
    stream = build_stream("flickr8k-languages", languages=("de", "fr"), max_train_per_task=40, max_eval_per_task=4)
    model = tiny_clip(seed=0)
    model.get_input_embeddings().weight.requires_grad_(False)
    old = model.get_input_embeddings().weight.detach().clone()
    method = build_methods(["grow_vocab"], {"grow_vocab": {"vocab_size": 800, "init": init, "seed": 5}})[0]
    context = TaskContext(task_index=0, task=stream[0], stream=stream, model=model, output_dir=tmp_path,
                          tokenizer=clip_tokenizer, max_length=77)
    method.on_task_start(context)
    grown, ids = context.tokenizer, context.new_token_ids
    assert grown is not clip_tokenizer and len(clip_tokenizer) == 49408
    assert ids == list(range(49408, len(grown))) and len(ids) > 100
    weight = model.get_input_embeddings().weight
    assert weight.shape[0] == len(grown) and not weight.requires_grad
    assert torch.equal(weight[:49408], old)
    new = weight[49408:].detach()
    if init == "teir":
        stats = method.history["de"]["stats"]["init"]
        assert stats["mean"] == pytest.approx(old.mean().item()) and stats["std"] == pytest.approx(old.std().item())
        tolerance = 5 * stats["std"] / math.sqrt(new.numel())
        assert abs(new.mean().item() - stats["mean"]) < tolerance
        assert new.std().item() == pytest.approx(stats["std"], rel=0.05)
    elif init == "fixed":
        assert new.std().item() == pytest.approx(0.02, rel=0.05)
    else:  # transformers' mean-resizing: centred on the old rows' per-dimension mean
        assert torch.allclose(new.mean(0), old.mean(0), atol=5 * old.std().item() / math.sqrt(len(ids)))
    with pytest.raises(ValueError, match="init must be one of"):
        build_methods(["grow_vocab"], {"grow_vocab": {"init": "zeros"}})


@pytest.fixture(scope="module")
def two_languages(tmp_path_factory, clip_tokenizer):
    stream = build_stream("flickr8k-languages", languages=("en", "de"), max_train_per_task=48, max_eval_per_task=24)
    output_dir = tmp_path_factory.mktemp("languages")
    methods = build_methods(["grow_vocab", "finetune"], {"grow_vocab": {
        "vocab_size": 600, "skip_languages": ["en"], "context_length": 96, "report_captions": 50}})
    args = ContinualArguments(output_dir=str(output_dir), progress=False, evaluation={"initial": False},
                              training={"max_steps": 3, "per_device_train_batch_size": 16, "learning_rate": 1e-3})
    learner = ContinualLearner(tiny_clip(seed=0), stream, methods, load_image_processor(32), clip_tokenizer, args)
    learner.fit()
    return learner, output_dir


def test_two_language_run_grows_and_saves_a_plain_clip(two_languages, clip_tokenizer):
    learner, output_dir = two_languages
    grow = learner.methods[0]
    assert grow.new_token_ids["en"] == []  # skipped
    added = grow.new_token_ids["de"]
    assert len(added) > 50 and added == list(range(len(clip_tokenizer), len(learner.tokenizer)))
    assert learner.model.get_input_embeddings().num_embeddings == len(learner.tokenizer)
    assert learner.model.config.text_config.max_position_embeddings == 96 == learner.max_length
    assert learner.results.headline().shape == (2, 2)
    saved = json.loads((output_dir / "task-1" / "method_state.json").read_text())["grow_vocab"]["state"]["history"]
    assert saved["de"]["ids"] == added and saved["de"]["vocab_size"] == len(learner.tokenizer)
    assert saved["de"]["report"]["languages"]["protected"]["changed_fraction"] == 0.0

    folder = output_dir / "task-1"
    plain = CLIPModel.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert len(tokenizer) == len(learner.tokenizer) and tokenizer.model_max_length == 96
    texts = learner.stream[1].eval["texts"][0][:1] + learner.stream[0].eval["texts"][0][:2]
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    assert inputs.input_ids.tolist() == learner.tokenizer(texts, padding=True, return_tensors="pt").input_ids.tolist()
    assert int(inputs.input_ids.max()) >= len(clip_tokenizer)  # German uses the new tokens
    english = clip_tokenizer(texts[1:], padding=True, return_tensors="pt").input_ids
    assert torch.equal(inputs.input_ids[1:, : english.shape[1]], english)  # English ids as with CLIP's tokenizer
    learner.model.eval()
    with torch.no_grad():
        ours = learner.model.embed_texts(inputs.input_ids, inputs.attention_mask, normalize=False)
        theirs = plain.get_text_features(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).pooler_output
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_resume_regrows_the_same_vocabulary(two_languages, clip_tokenizer, tmp_path):
    """Resuming after task 0 (context grown to 96, English skipped) on a fresh 77-position model redoes task 1 exactly:
    the German BPE is deterministic, so the same tokens get the same ids and the same initial rows."""
    learner, output_dir = two_languages
    methods = build_methods(["grow_vocab", "finetune"], {"grow_vocab": {
        "vocab_size": 600, "skip_languages": ["en"], "context_length": 96, "report_captions": 50}})
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, resume_from_checkpoint=str(output_dir / "task-0"),
                              training={"max_steps": 3, "per_device_train_batch_size": 16, "learning_rate": 1e-3})
    resumed = ContinualLearner(tiny_clip(seed=1), learner.stream, methods, load_image_processor(32), clip_tokenizer, args)
    resumed.fit()
    assert resumed.tokenizer.get_vocab() == learner.tokenizer.get_vocab()
    assert methods[0].new_token_ids == learner.methods[0].new_token_ids
    assert resumed.model.config.text_config.max_position_embeddings == 96
    ours, theirs = resumed.model.state_dict(), learner.model.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.allclose(ours[name], value, atol=1e-6), name
    np.testing.assert_allclose(resumed.results.headline(), learner.results.headline(), atol=1e-6)
