"""ZSCL: the distillation by hand, the reference batches (per step, resumable, images and texts drawn apart), the
initial model as the teacher of every task, the paper's and the code's text side, and the weight ensemble."""

import math

import pytest
import torch

from hf_ccl.data import CLIPCollator, build_stream, load_tokenizer
from hf_ccl.data.reference import ReferenceBatches, ReferenceData, load_reference
from hf_ccl.families import default_image_processor
from hf_ccl.methods import TaskContext, build_methods
from hf_ccl.methods.zscl import ZSCL, zscl_distillation
from hf_ccl.testing import tiny_model
from hf_ccl.validation import ConfigError

SMALL = {"reference_examples": 24, "reference_batch_size": 8}


def test_distillation_by_hand():
    teacher = torch.tensor([[2.0, 0.0]])
    student = torch.tensor([[0.0, 0.0]])
    # T = 2: target softmax([1, 0]) = [a, 1 - a]; student softmax([0, 0]) = [1/2, 1/2]; CE = ln 2; times T^2 = 4.
    assert float(zscl_distillation(teacher, student, 2.0)) == pytest.approx(4 * math.log(2), rel=1e-6)
    a = 1 / (1 + math.exp(-1))
    student = torch.tensor([[2.0, 0.0]])  # the same logits: CE = the target's entropy (the code's value, not a KL)
    entropy = -(a * math.log(a) + (1 - a) * math.log(1 - a))
    assert float(zscl_distillation(teacher, student, 2.0)) == pytest.approx(4 * entropy, rel=1e-6)


@pytest.fixture(scope="module")
def reference():
    return ReferenceData(load_reference("flickr8k", examples=24), batch_size=8)


def test_reference_batches_are_per_step_and_unpaired(reference, clip_tokenizer):
    model = tiny_model()
    collator = CLIPCollator(default_image_processor(model), clip_tokenizer, train=False)
    batches = ReferenceBatches(reference, collator, seed=3, task_index=1)
    first, again, other = batches.batch(5), batches.batch(5), batches.batch(6)
    assert first["pixel_values"].shape[0] == first["input_ids"].shape[0] == 8
    torch.testing.assert_close(first["pixel_values"], again["pixel_values"])  # a resumed step draws the same batch
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert not torch.equal(first["pixel_values"], other["pixel_values"])
    images, texts, _ = batches.rows(5)
    assert sorted(images.tolist()) != sorted(texts.tolist())  # images and texts drawn apart


def context_for(model, reference, clip_tokenizer, step=0, index=0):
    stream = build_stream("digits", max_train_per_task=16)
    context = TaskContext(task_index=index, task=stream[index], stream=stream, model=model, global_step=step)
    collator = CLIPCollator(default_image_processor(model), clip_tokenizer, train=False)
    context.references["zscl"] = ReferenceBatches(reference, collator, seed=0, task_index=index)
    return context


def test_loss_is_the_hand_computed_distillation_from_the_initial_model(reference, clip_tokenizer):
    model = tiny_model()
    method = ZSCL({**SMALL, "weight_ensemble": False})
    context = context_for(model, reference, clip_tokenizer)
    method.on_task_start(context)
    with torch.no_grad():  # the student moves away from the initial model
        model.visual_projection.weight.mul_(0.5).add_(0.1)
    terms = method.loss_terms(model, {}, None, context)
    batch = context.reference_batch(method)
    teacher = tiny_model()  # the same seed: the initial weights
    with torch.no_grad():
        old = teacher.logit_scale.exp() * teacher.embed_images(batch["pixel_values"]) @ teacher.embed_texts(
            batch["input_ids"], batch["attention_mask"]).t()
        new = model.logit_scale.exp() * model.embed_images(batch["pixel_values"]) @ model.embed_texts(
            batch["input_ids"], batch["attention_mask"]).t()
    expected = zscl_distillation(old, new) + zscl_distillation(old.t(), new.t())
    torch.testing.assert_close(terms["distillation"].detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("student_texts", [True, False])
def test_the_code_variant_leaves_the_text_tower_undistilled(reference, clip_tokenizer, student_texts):
    model = tiny_model()
    method = ZSCL({**SMALL, "weight_ensemble": False, "student_texts": student_texts})
    context = context_for(model, reference, clip_tokenizer)
    method.on_task_start(context)
    with torch.no_grad():
        model.visual_projection.weight.mul_(0.5)
    method.loss_terms(model, {}, None, context)["distillation"].backward()
    text_grad = model.text_projection.weight.grad
    assert (text_grad is not None and text_grad.abs().sum() > 0) == student_texts
    assert model.visual_projection.weight.grad.abs().sum() > 0


def test_every_task_distils_the_initial_model_and_the_state_restores_it(tmp_path):
    stream = build_stream("digits", max_train_per_task=32)
    stream.tasks = stream.tasks[:2]
    from hf_ccl.continual import ContinualArguments, ContinualLearner

    model = tiny_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    methods = build_methods(["zscl"], {"zscl": {**SMALL, "ensemble_every": 1}})
    seen = []
    original = ZSCL.on_task_start

    def record(self, context):
        original(self, context)
        seen.append({k: v.clone() for k, v in self.teacher.state_dict().items()})

    ZSCL.on_task_start = record
    try:
        args = ContinualArguments(output_dir=str(tmp_path), save_checkpoints=False, progress=False,
                                  evaluation={"initial": False},
                                  training={"num_train_epochs": 1, "per_device_train_batch_size": 8})
        ContinualLearner(model, stream, methods, default_image_processor(model), load_tokenizer(), args).fit()
    finally:
        ZSCL.on_task_start = original
    assert len(seen) == 2
    for teacher in seen:  # task 1's teacher is the initial model, not task 0's
        for name, tensor in initial.items():
            assert torch.equal(teacher[name], tensor), name
    state = methods[0].state_dict()
    restored = ZSCL({**SMALL})
    restored.load_state_dict(state)
    assert all(torch.equal(restored.initial[k], v) for k, v in initial.items())


def test_bad_options_are_refused():
    for options, key in (({"temperature": 0}, "temperature"), ({"directions": ["x"]}, "directions"),
                         ({"reference_batch_size": 1}, "reference_batch_size"), ({"l2": -1}, "l2"),
                         ({"reference": " "}, "reference")):
        with pytest.raises(ConfigError, match=f"method_args.zscl.*{key}"):
            build_methods(["zscl"], {"zscl": options})


def test_a_task_shorter_than_the_ensemble_interval_is_refused_not_discarded(tmp_path):
    """4 optimizer steps with ensemble_every=10: the mean would be the task's starting weights (all its training
    thrown away), so the run stops with the reason before it trains (the apply-time guard stays for a task that
    turns out shorter than planned)."""
    from hf_ccl.continual import ContinualArguments, ContinualLearner

    stream = build_stream("digits", max_train_per_task=32)
    stream.tasks = stream.tasks[:1]
    model = tiny_model()
    args = ContinualArguments(output_dir=str(tmp_path), save_checkpoints=False, progress=False, evaluation={"initial": False},
                              training={"num_train_epochs": 1, "per_device_train_batch_size": 8})
    learner = ContinualLearner(model, stream, build_methods(["zscl"], {"zscl": {**SMALL, "ensemble_every": 10}}),
                               default_image_processor(model), load_tokenizer(), args)
    with pytest.raises(ValueError, match=r"trains 4 optimizer step\(s\), fewer than .*ensemble_every=10"):
        learner.fit()
    assert learner.results.num_trained == 0
