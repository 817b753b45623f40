"""TEIR's regularisation (specs/cllclip.md §3.2, Eqs. 5–6): λ by hand, the AdamW step by hand, untouched rows and
special tokens bit-identical after training, and its compositions with CLL-CLIP, EWC, ER and DER."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from language_tasks import language_stream
from transformers import TrainingArguments

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.methods.teir import TEIR, extend_frequencies, initial_frequencies, row_scales, token_presence
from hf_ccl.testing import tiny_clip
from hf_ccl.trainer import ContinualTrainer

EMBEDDING = "text_model.embeddings.token_embedding.weight"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def stream(shared_data_root):
    return language_stream(shared_data_root, ("en", "de"), images=6)


def _presence(tokenizer, tasks) -> set[int]:
    ids: set[int] = set()
    for task in tasks:
        for texts in task.train["texts"]:
            ids.update(i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row)
    return ids


# ----- Eq. 6 by hand ----------------------------------------------------------------------------------------------
def test_row_scales_by_hand():
    freq = torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 3.0])
    present = torch.tensor([True, False, True, True, False, True])
    # present/freq: 1/2, 0 (V_old), 1/2, 1 (V_new), 0 (never emitted), 1/3 -> frozen special at row 5.
    assert row_scales(present, freq, frozen_ids=[5]).tolist() == [0.5, 0.0, 0.5, 1.0, 0.0, 0.0]
    assert initial_frequencies(6, new_token_ids=[4, 5]).tolist() == [2, 2, 2, 2, 1, 1]
    assert initial_frequencies(3, pretrained_counts=False).tolist() == [1, 1, 1]
    assert extend_frequencies(torch.tensor([3.0, 2.0]), 4).tolist() == [3, 2, 1, 1]
    with pytest.raises(ValueError, match="shrank"):
        extend_frequencies(torch.ones(4), 3)


def test_frequencies_follow_the_worked_examples(tokenizer):
    """Spec §3.2: an original token seen in the first task gets λ = 1/2, then 1/3; a token new at task 2 gets 1, then
    1/2; an original token first seen at task 3 gets 1/2; special tokens 0; absent tokens 0."""
    grown = copy.deepcopy(tokenizer)
    grown.add_tokens(["qqxyz"])
    new_id = grown.convert_tokens_to_ids("qqxyz")
    a, dog, cat = (grown(w, add_special_tokens=False)["input_ids"][0] for w in ("a", "dog", "cat"))
    model = tiny_clip(seed=0)
    method = TEIR()
    texts = [["a dog", "dog a"], ["a qqxyz"], ["qqxyz cat"]]
    expected = [{a: 1 / 2, dog: 1 / 2, cat: 0.0}, {a: 1 / 3, dog: 0.0, new_id: 1.0}, {a: 0.0, new_id: 1 / 2, cat: 1 / 2}]
    for index, (captions, wanted) in enumerate(zip(texts, expected, strict=True)):
        fields = {"tokenizer": tokenizer if index == 0 else grown, "new_token_ids": [] if index != 1 else [new_id]}
        if index == 1:
            model.resize_token_embeddings(len(grown), mean_resizing=False)
        data = Dataset.from_dict({"texts": [captions]})
        context = TaskContext(index, None, None, model, output_dir=None, **fields)
        scales = method.prepare(context, data)
        assert scales.shape == (model.get_input_embeddings().num_embeddings,)
        for token, value in wanted.items():
            assert scales[token].item() == pytest.approx(value), (index, token)
        assert all(scales[i].item() == 0.0 for i in tokenizer.all_special_ids)
        assert int((scales > 0).sum()) == len(set(wanted) - {t for t, v in wanted.items() if v == 0})
        method.on_task_end(context)
    assert method.frequencies[a].item() == 4 and method.frequencies[new_id].item() == 3


def test_token_presence_is_the_tokenized_captions(tokenizer):
    present = token_presence(["a photo of a cat", "two dogs"], tokenizer, 49408)
    expected = {i for t in ("a photo of a cat", "two dogs") for i in tokenizer(t, add_special_tokens=False)["input_ids"]}
    assert set(present.nonzero().squeeze(1).tolist()) == expected
    with pytest.raises(ValueError, match="token embedding has 100 rows"):
        token_presence(["a cat"], tokenizer, 100)


# ----- Eq. 5 on AdamW by hand ----------------------------------------------------------------------------------
def test_adamw_step_scales_gradient_and_decay_per_row():
    model = tiny_clip(seed=0, vocab_size=6)
    weight = model.get_input_embeddings().weight
    method = TEIR()
    method.scales = torch.tensor([0.5, 0.0, 1.0, 1 / 3, 0.0, 0.25])
    lr, beta, eps = 0.1, 0.05, 1e-6
    optimizer = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.0}], lr=lr, eps=eps)
    context = TaskContext(0, None, None, model, output_dir=None,
                          optimizer=optimizer, training_args=SimpleNamespace(weight_decay=beta))
    before = weight.detach().clone()
    gradient = torch.randn_like(weight)
    # A step the fp16 GradScaler skips: armed, but the optimizer never steps; nothing may be decayed twice.
    weight.grad = gradient.clone()
    method.pre_optimizer_step(model, context)
    weight.grad = gradient.clone()
    method.pre_optimizer_step(model, context)
    optimizer.step()
    lam = method.scales[:, None]
    scaled = lam * gradient  # G <- λ G, before Adam's moments; first step: m̂ = G, v̂ = G²
    expected = before * (1 - lr * beta * lam) - lr * scaled / (scaled.abs() + eps)
    after = weight.detach()
    assert torch.allclose(after, expected, atol=1e-7, rtol=1e-6)
    assert torch.equal(after[1], before[1]) and torch.equal(after[4], before[4])  # λ = 0: bit-identical
    assert method._hook is None  # the one-shot decay hook fired once and is gone
    decayed_wrong = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.01}], lr=lr)
    context.optimizer = decayed_wrong
    with pytest.raises(ValueError, match="also decays the token embedding"):
        method.pre_optimizer_step(model, context)


def test_the_optimizer_leaves_the_embedding_decay_to_teir(tmp_path):
    model = tiny_clip(seed=0)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], weight_decay=0.05)
    decayed = ContinualTrainer(model=model, args=args, methods=[TEIR()]).get_decay_parameter_names(model)
    plain = ContinualTrainer(model=model, args=args, methods=[]).get_decay_parameter_names(model)
    assert EMBEDDING in plain and EMBEDDING not in decayed and set(plain) - set(decayed) == {EMBEDDING}
    both = ContinualTrainer(model=model, args=args, methods=[TEIR({"scale_weight_decay": False})])
    assert EMBEDDING in both.get_decay_parameter_names(model)


# ----- training: untouched rows and specials stay bit-identical ----------------------------------------------
def _fit(stream, tokenizer, tmp_path, names, options=None, steps=3):
    training = {"max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "weight_decay": 0.05,
                "warmup_steps": 0, "lr_scheduler_type": "linear"}
    args = ContinualArguments(output_dir=str(tmp_path), training=training, progress=False, evaluation={"initial": False},
                              save_checkpoints=False)
    methods = build_methods(names, options)
    model = tiny_clip(seed=0)
    initial = model.get_input_embeddings().weight.detach().clone()
    learner = ContinualLearner(model, stream, methods, load_image_processor(32), tokenizer, args)
    learner.fit()
    return learner, methods, initial


def _changed_rows(learner, initial) -> set[int]:
    weight = learner.model.get_input_embeddings().weight.detach()[: len(initial)]
    return set((weight != initial).any(dim=1).nonzero().squeeze(1).tolist())


def test_only_rows_of_the_tasks_tokens_change_and_specials_are_frozen(stream, tokenizer, tmp_path):
    learner, methods, initial = _fit(stream, tokenizer, tmp_path / "teir", ["cllclip", "teir"])
    present = _presence(tokenizer, stream)
    assert _changed_rows(learner, initial) == present  # every row with λ > 0 decays; all others bit-identical
    assert not present & set(tokenizer.all_special_ids)
    teir = methods[1]
    english_only = _presence(tokenizer, stream.tasks[:1]) - _presence(tokenizer, stream.tasks[1:])
    both = _presence(tokenizer, stream.tasks[:1]) & _presence(tokenizer, stream.tasks[1:])
    assert {teir.frequencies[i].item() for i in english_only} == {3.0}  # 1 + CLIP + en
    assert {teir.frequencies[i].item() for i in both} == {4.0}
    # Without TEIR the AdamW decay shrinks every row (spec §9 A22).
    baseline, _, initial = _fit(stream, tokenizer, tmp_path / "plain", ["cllclip"], steps=1)
    assert len(_changed_rows(baseline, initial)) == len(initial)


def test_state_round_trip(tmp_path):
    method = TEIR()
    method.frequencies = torch.tensor([3.0, 2.0, 1.0])
    save_method_states([method], tmp_path)
    restored = TEIR()
    load_method_states([restored], tmp_path)
    assert torch.equal(restored.frequencies, method.frequencies)
    assert TEIR().state_dict() == {}


def test_streaming_tasks_are_refused(tokenizer):
    data = Dataset.from_dict({"texts": [["a cat"]]}).to_iterable_dataset()
    context = TaskContext(0, None, None, tiny_clip(seed=0), output_dir=None, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="streaming"):
        TEIR().prepare(context, data)


# ----- compositions --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("names", [["cllclip", "ewc", "teir"], ["cllclip", "er", "teir"], ["cllclip", "der", "teir"]])
def test_compositions_train_and_keep_untouched_rows(stream, tokenizer, tmp_path, names):
    learner, methods, initial = _fit(stream, tokenizer, tmp_path, names, steps=2)
    changed = _changed_rows(learner, initial)
    assert changed and changed <= _presence(tokenizer, stream)
    assert not changed & set(tokenizer.all_special_ids)
    if names[1] in ("er", "der"):  # replayed English rows count again in task 2 (teir comes after the buffer)
        english_only = _presence(tokenizer, stream.tasks[:1]) - _presence(tokenizer, stream.tasks[1:])
        if names[1] == "er":
            assert {methods[2].frequencies[i].item() for i in english_only} == {4.0}
        else:  # DER replays each buffered row's recorded caption only
            assert max(methods[2].frequencies[i].item() for i in english_only) == 4.0


def test_composes_with_vocabulary_growth(shared_data_root, tokenizer, tmp_path):
    stream = language_stream(shared_data_root, ("en", "de"), images=4)
    learner, methods, _ = _fit(stream, tokenizer, tmp_path, ["cllclip", "grow_vocab", "teir"],
                               {"grow_vocab": {"vocab_size": 2000}}, steps=1)
    teir, grow = methods[2], methods[1]
    assert teir.frequencies.shape == (len(learner.tokenizer),)
    german = set(grow.new_token_ids["de"])
    emitted = _presence(learner.tokenizer, stream.tasks[1:]) & german
    assert emitted and {teir.frequencies[i].item() for i in emitted} == {2.0}  # new at task 2: 1, then +1
    assert {teir.frequencies[i].item() for i in german - emitted} <= {1.0}


def test_missing_text_column_is_an_error(tokenizer):
    data = Dataset.from_dict({"captions": [["a cat"]]})
    context = TaskContext(0, None, None, tiny_clip(seed=0), output_dir=None, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="no 'texts' column"):
        TEIR().prepare(context, data)
