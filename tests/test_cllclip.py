"""CLL-CLIP (specs/cllclip.md §2): Eqs. 2–3 by hand, the frozen initial teacher, embedding-only training, the
parallel English captions, and an exact resume."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from language_tasks import language_stream
from transformers import CLIPProcessor, TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, load_image_processor, load_tokenizer
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.cllclip import CLLCLIP, cross_lingual_loss, cross_modal_loss, tensor_digest
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.testing import tiny_clip
from hf_ccl.trainer import ContinualTrainer

EMBEDDING = "text_model.embeddings.token_embedding.weight"
TRAINING = {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "weight_decay": 0.0,
            "logging_steps": 1}


@pytest.fixture(scope="module")
def stream(shared_data_root):
    return language_stream(shared_data_root, ("en", "de"), images=6)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _fit(stream, tokenizer, output_dir, methods, training=TRAINING, model=None, callbacks=None, **kwargs):
    args = ContinualArguments(output_dir=str(output_dir), training=dict(training), progress=False,
                              evaluation={"initial": False}, **kwargs)
    learner = ContinualLearner(model or tiny_clip(seed=0), stream, methods, load_image_processor(32), tokenizer, args,
                               callbacks=callbacks)
    learner.fit()
    return learner


# ----- Eqs. 2–3 by hand ---------------------------------------------------------------------------------------
def test_cross_lingual_loss_by_hand():
    student = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    teacher = torch.zeros(2, 3)
    # Σ_k ‖r^E_k − r^F_k‖² = 1 + 4 = 5 over K = 2 rows, D = 3 dims.
    assert cross_lingual_loss(student, teacher, "mean").item() == pytest.approx(5 / 6)  # code: mean over K·D
    assert cross_lingual_loss(student, teacher, "paper").item() == pytest.approx(5 / 4)  # Eq. 3: (1/2K) Σ ‖·‖²
    with pytest.raises(ValueError, match="cl_reduction"):
        cross_lingual_loss(student, teacher, "sum")


def test_cross_modal_loss_with_two_captions_of_one_image_by_hand():
    # Rows 0 and 1 are two captions of one image (same image id, same image features): both are positives.
    texts = torch.tensor([[1.0, 0.0], [0.0, 3.0], [1.0, 1.0]])  # unnormalised: normalised inside
    images = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    ids = torch.tensor([7, 7, 9])
    tau = 0.5
    t = [[1.0, 0.0], [0.0, 1.0], [1 / math.sqrt(2), 1 / math.sqrt(2)]]
    v = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    cos = [[sum(a * b for a, b in zip(v[k], t[j], strict=True)) for j in range(3)] for k in range(3)]
    targets = [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]  # P_kl = 1[same image] / #positives

    def direction(logits):  # −(1/K) Σ_k Σ_l P_kl log softmax_l(logits_k)
        total = 0.0
        for k in range(3):
            norm = math.log(sum(math.exp(x) for x in logits[k]))
            total -= sum(targets[k][j] * (logits[k][j] - norm) for j in range(3))
        return total / 3

    i2f = direction([[cos[k][j] / tau for j in range(3)] for k in range(3)])
    f2i = direction([[cos[j][k] / tau for j in range(3)] for k in range(3)])
    expected = 0.5 * (i2f + f2i)
    assert cross_modal_loss(texts, images, ids, torch.tensor(tau)).item() == pytest.approx(expected, rel=1e-6)
    # Unique images: Eq. 2's diagonal InfoNCE.
    unique = cross_modal_loss(texts, images, torch.tensor([1, 2, 3]), tau)
    logits = torch.nn.functional.normalize(images, dim=-1) @ torch.nn.functional.normalize(texts, dim=-1).t() / tau
    diagonal = 0.5 * (torch.nn.functional.cross_entropy(logits, torch.arange(3))
                      + torch.nn.functional.cross_entropy(logits.t(), torch.arange(3)))
    assert unique.item() == pytest.approx(diagonal.item(), rel=1e-6)


def test_loss_terms_are_weighted_eqs_2_and_3(stream, tokenizer):
    model = tiny_clip(seed=0)
    model.align_special_tokens(tokenizer)
    method = CLLCLIP({"cross_modal_weight": 0.01, "cross_lingual_weight": 1.0})
    context = TaskContext(1, stream[1], stream, model, output_dir=None, tokenizer=tokenizer)
    method.on_task_start(context)
    collator = CLIPCollator(load_image_processor(32), tokenizer, seed=0, **method.collator_options(context))
    batch = collator([stream[1].train[i] for i in range(4)])
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    pixel_values=batch["pixel_values"], features_only=True)
    terms = method.loss_terms(model, batch, outputs, context)
    with torch.no_grad():
        r_f = model.embed_texts(batch["input_ids"], batch["attention_mask"], normalize=False)
        r_e = model.embed_texts(batch["parallel_input_ids"], batch["parallel_attention_mask"], normalize=False)
        r_i = model.embed_images(batch["pixel_values"], normalize=False)
    assert terms["cross_lingual"].item() == pytest.approx(((r_f - r_e) ** 2).mean().item(), rel=1e-5)
    expected_cm = 0.01 * cross_modal_loss(r_f, r_i, batch["image_hash"], 0.07)
    assert terms["cross_modal"].item() == pytest.approx(expected_cm.item(), rel=1e-5)
    # The English task: texts_en is texts, pairing by index: x^E = x^F, so r^F = r^E and L_cl = 0 before training.
    english = CLIPCollator(load_image_processor(32), tokenizer, seed=0, **method.collator_options(context))
    en_batch = english([stream[0].train[i] for i in range(4)])
    assert torch.equal(en_batch["input_ids"], en_batch["parallel_input_ids"])
    en_outputs = model(input_ids=en_batch["input_ids"], attention_mask=en_batch["attention_mask"],
                       pixel_values=en_batch["pixel_values"], features_only=True)
    assert method.loss_terms(model, en_batch, en_outputs, context)["cross_lingual"].item() == 0.0


# ----- training: the teacher, the frozen tower, untouched rows -------------------------------------------------
@pytest.fixture(scope="module")
def trained(stream, tokenizer, tmp_path_factory):
    model = tiny_clip(seed=0)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    methods = build_methods(["cllclip"])
    output_dir = tmp_path_factory.mktemp("cllclip")
    logs = _Logs()
    learner = _fit(stream, tokenizer, output_dir, methods, model=model, callbacks=[logs])
    return learner, methods[0], initial, output_dir, logs.logs


def test_teacher_is_the_frozen_initial_clip(trained):
    learner, method, initial, *_ = trained
    teacher = method.teacher.model
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters()) and not teacher.training
    assert {name: value for name, value in teacher.state_dict().items()}.keys() == initial.keys()
    assert all(torch.equal(value, initial[name]) for name, value in teacher.state_dict().items())
    assert not torch.equal(learner.model.state_dict()[EMBEDDING], initial[EMBEDDING])  # the student did train


def test_only_token_rows_of_the_tasks_change(trained, stream, tokenizer):
    learner, method, initial, *_ = trained
    after = learner.model.state_dict()
    assert [name for name in initial if not torch.equal(initial[name], after[name])] == [EMBEDDING]
    present = set(tokenizer.all_special_ids)  # BOS and EOS train in plain CLL-CLIP
    for task in stream:
        for texts in task.train["texts"]:
            present.update(i for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in ids)
    changed = (after[EMBEDDING] != initial[EMBEDDING]).any(dim=1).nonzero().squeeze(1).tolist()
    assert changed and set(changed) <= present  # weight_decay=0: rows of absent tokens are bit-identical
    assert method.temperature.item() != pytest.approx(0.07)  # τ trained


def _args(tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "t"), report_to=[], weight_decay=0.05)


def test_temperature_is_an_optimizer_group_without_decay(stream, tokenizer, tmp_path):
    model = tiny_clip(seed=0)
    model.align_special_tokens(tokenizer)
    method = CLLCLIP()
    context = TaskContext(0, stream[0], stream, model, output_dir=None, tokenizer=tokenizer)
    method.on_task_start(context)
    trainer = ContinualTrainer(model=model, methods=[method], args=_args(tmp_path), context=context)
    optimizer = trainer.create_optimizer()
    groups = [g for g in optimizer.param_groups if any(p is method.temperature for p in g["params"])]
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0 and len(groups[0]["params"]) == 1
    trained = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(trained) == 2 and any(p is model.get_input_embeddings().weight for p in trained)
    assert context.optimizer is optimizer and context.training_args is trainer.args


def test_loss_is_the_methods_terms_alone(trained):
    *_, logs = trained
    losses = [entry for entry in logs if "loss/cllclip/cross_lingual" in entry]
    assert losses and all("loss/cllclip/cross_modal" in entry for entry in losses)
    assert not any("loss/contrastive" in entry for entry in logs)
    assert all(entry["cllclip/temperature"] > 0 for entry in losses)


# ----- state and resume ---------------------------------------------------------------------------------------
def test_state_round_trip_rebuilds_the_teacher_exactly(trained, tmp_path):
    learner, method, initial, *_ = trained
    state = method.state_dict()
    teacher_state = state["teacher"]
    assert set(teacher_state["tensors"]) == set()  # only the changed embedding rows are stored
    rows = teacher_state["rows"][EMBEDDING]
    assert 0 < len(rows["index"]) < 1000
    save_method_states([method], tmp_path)
    restored = CLLCLIP()
    load_method_states([restored], tmp_path)
    assert restored.temperature.item() == method.temperature.item()
    assert restored.tokenizer("ein Hund")["input_ids"] == method.tokenizer("ein Hund")["input_ids"]
    teacher = restored._ensure_teacher(learner.model).model
    assert all(torch.equal(value, initial[name]) for name, value in teacher.state_dict().items())
    # A model that is not the one the state was saved with is refused.
    other = CLLCLIP()
    load_method_states([other], tmp_path)
    with pytest.raises(ValueError, match="cannot rebuild the teacher"):
        other._ensure_teacher(tiny_clip(seed=1))
    digest = tensor_digest(initial[EMBEDDING])
    assert teacher_state["digests"][EMBEDDING] == digest


def test_resume_after_a_task_is_exact(trained, stream, tokenizer, tmp_path):
    learner, method, _, output_dir, _ = trained
    run = tmp_path / "run"
    shutil.copytree(output_dir / "task-0", run / "task-0")
    methods = build_methods(["cllclip"])
    resumed = _fit(stream, tokenizer, run, methods, resume_from_checkpoint=True)
    assert torch.equal(resumed.model.state_dict()[EMBEDDING], learner.model.state_dict()[EMBEDDING])
    assert methods[0].temperature.item() == method.temperature.item()


def _saved_tokenizer(method: CLLCLIP) -> dict[str, bytes]:
    return {name: data.numpy().tobytes() for name, data in method.state_dict()["tokenizer"].items()}


def test_the_saved_tokenizer_is_the_one_captured_at_the_first_task_start(stream, tmp_path):
    """The state saves the original tokenizer as it was captured, not the live one re-serialised: not changed by
    the main process saving a checkpoint's processor with it (the same state on every rank), nor by a save and load
    (the same state in a resumed run)."""
    tokenizer, model = load_tokenizer(), tiny_clip(seed=0)
    method = CLLCLIP()
    method.on_task_start(TaskContext(0, stream[0], stream, model, output_dir=None, tokenizer=tokenizer))
    captured = _saved_tokenizer(method)
    CLIPProcessor(image_processor=load_image_processor(32), tokenizer=tokenizer).save_pretrained(tmp_path / "task-0")
    assert _saved_tokenizer(method) == captured
    save_method_states([method], tmp_path)
    restored = CLLCLIP()
    load_method_states([restored], tmp_path)
    restored.on_task_start(TaskContext(1, stream[1], stream, model, output_dir=None, tokenizer=tokenizer))
    assert _saved_tokenizer(restored) == captured


def test_order_and_data_errors(stream, tokenizer):
    model = tiny_clip(seed=0)
    method = CLLCLIP()
    grown = TaskContext(0, stream[0], stream, model, output_dir=None,
                        tokenizer=tokenizer, new_token_ids=[49408])
    with pytest.raises(ValueError, match="before vocabulary growth"):
        method.on_task_start(grown)
    missing = CLLCLIP({"parallel_text_column": "texts_fr", "require_parallel": True})
    context = TaskContext(0, stream[0], stream, model, output_dir=None, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="no 'texts_fr' column"):
        missing.on_task_start(context)
    english = CLLCLIP({"parallel_text_column": "texts_fr"})  # a task without it is English: x^E = x^F
    english.on_task_start(context)
    assert english.collator_options(context)["parallel_text_column"] == "texts"
    with pytest.raises(ValueError, match="Unknown option"):
        CLLCLIP({"gamma": 1})
