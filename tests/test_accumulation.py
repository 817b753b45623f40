"""Exact gradient accumulation: one optimizer step of 32 x 2 equals one of 64 x 1, for the contrastive loss and for
every method's terms (`hf_ccl.accumulation`; the representative methods of `tests/method_matrix.py` by default,
every method under `-m slow`). With randomness in the forward pass (dropout, noisy gating) the step's gradient is
the gradient of the loss it computed, its random draws replayed chunk by chunk."""

from __future__ import annotations

import math

import pytest
import torch
from method_matrix import PAIR_ONLY, REPRESENTATIVE_MATRIX, LogRecorder, run_method

from hf_ccl.accumulation import RNGState, accumulated_backward, concat_batches
from hf_ccl.data.task import TaskStream
from hf_ccl.losses import clip_contrastive_loss
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.testing import random_image_inputs, tiny_model


def test_concat_batches_pads_token_matrices_and_keeps_rows():
    first = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 1]]),
             "pixel_values": torch.zeros(1, 3, 2, 2), "text_hash": torch.tensor([7])}
    second = {"input_ids": torch.tensor([[4, 5], [6, 7]]), "attention_mask": torch.tensor([[1, 1], [1, 0]]),
              "pixel_values": torch.ones(2, 3, 2, 2), "text_hash": torch.tensor([8, 9])}
    merged = concat_batches([first, second])
    assert merged["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0], [6, 7, 0]]
    assert merged["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert merged["pixel_values"].shape == (3, 3, 2, 2) and merged["text_hash"].tolist() == [7, 8, 9]


class _Towers(torch.nn.Module):
    """Two linear towers with dropout and a temperature: small enough to check the chain rule by hand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(5, 4)
        self.text = torch.nn.Linear(6, 4)
        self.dropout = torch.nn.Dropout(0.3)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def encode(self, batch):
        return self.dropout(self.image(batch["x"])), self.text(batch["y"])

    def loss(self, image, text):
        image, text = torch.nn.functional.normalize(image, dim=-1), torch.nn.functional.normalize(text, dim=-1)
        contrastive = clip_contrastive_loss(self.logit_scale.exp() * image @ text.t())
        return contrastive + 0.01 * self.text.weight.pow(2).sum()  # a term on the parameters themselves (EWC-like)


def test_accumulated_gradient_equals_the_whole_batch_gradient():
    """Chunks of 3 + 3 + 2 rows give the gradient of the loss over all 8 rows, dropout masks replayed, including
    the gradient of the temperature and of a term on the parameters."""
    model = _Towers()
    batch = {"x": torch.randn(8, 5), "y": torch.randn(8, 6)}
    chunks = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 3), slice(3, 6), slice(6, 8))]
    generator_state = torch.get_rng_state()
    masks = []  # the dropout masks the whole-batch reference must use: those drawn for each chunk in turn
    for chunk in chunks:
        masks.append(torch.nn.functional.dropout(torch.ones(chunk["x"].shape[0], 4), 0.3))
    torch.set_rng_state(generator_state)
    loss = accumulated_backward(
        chunks, model.encode, lambda merged, image, text: model.loss(image, text), list(model.parameters()),
        lambda surrogate: surrogate.backward(),
    )
    accumulated = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    image = model.image(batch["x"]) * torch.cat(masks)
    reference = model.loss(image, model.text(batch["y"]))
    reference.backward()
    assert float(loss) == pytest.approx(float(reference.detach()), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(accumulated[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert accumulated["logit_scale"].abs() > 0 and accumulated["image.weight"].abs().sum() > 0


#: Every source of randomness in a training forward, at its default where it has one: MoE-Adapters' expert dropout
#: and noisy gating, LoRA's dropout, and the dropout of AltCLIP's and Chinese-CLIP's BERT-style text towers.
RANDOM_FORWARDS = {
    "moe_adapters": ("clip", ["moe_adapters"], {"moe_adapters": {"num_experts": 4, "bottleneck": 4}}),
    "lora": ("clip", ["lora"], {"lora": {"dropout": 0.1}}),
    "altclip_text_dropout": ("altclip", ["finetune"], {}),
    "chinese_clip_text_dropout": ("chinese_clip", ["finetune"], {}),
}


def _random_steps(case: str, tokenizer) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """The loss and the gradients of one step on 8 examples in chunks of 4 + 4, each from the same generator state:
    `replayed` (exact accumulation), `unreplayed` (the same without replaying the draws) and `graph` (the reference:
    each chunk encoded once, with gradients, then the loss over all 8 back-propagated: the gradient of that loss)."""
    family, names, options = RANDOM_FORWARDS[case]
    model = tiny_model(family, seed=0, hidden_size=32, projection_dim=32, num_layers=1)
    methods = build_methods(names, options)
    context = TaskContext(task_index=0, task=None, stream=TaskStream("s", []), model=model, seed=0)
    for method in methods:
        method.on_task_start(context)
    with torch.no_grad():  # the experts and routers start at zero, LoRA's B too: give the random paths a gradient
        for name, param in model.named_parameters():
            if param.requires_grad and ("moe_adapters." in name or "lora_B" in name):
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.train()
    tokens = tokenizer([f"a photo of the digit {i}" for i in range(8)], padding=True, return_tensors="pt")
    batch = {**model.text_inputs(tokens["input_ids"], tokens["attention_mask"]), **random_image_inputs(model, 8)}
    chunks = [{key: value[rows] for key, value in batch.items()} for rows in (slice(0, 4), slice(4, 8))]

    def encode(chunk):
        outputs = model(**chunk, features_only=True)
        return outputs.image_features, outputs.text_features

    def batch_loss(merged, image, text):
        outputs = model.contrastive_outputs(image, text, return_loss=True)
        return outputs.loss + sum(value for method in methods
                                  for value in method.loss_terms(model, merged, outputs, context).values())

    steps = {}
    restore = RNGState.restore
    for mode in ("replayed", "graph", "unreplayed"):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        if mode == "graph":
            features = [encode(chunk) for chunk in chunks]
            loss = batch_loss(batch, torch.cat([f[0] for f in features]), torch.cat([f[1] for f in features]))
            loss.backward()
        else:
            if mode == "unreplayed":
                RNGState.restore = lambda self: None
            try:
                loss = accumulated_backward(chunks, encode, batch_loss, list(model.parameters()),
                                            lambda surrogate: surrogate.backward())
            finally:
                RNGState.restore = restore
        steps[mode] = (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
    return steps


def _distance(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """|grads - reference| / |reference| over every parameter."""
    difference = sum(float((grads[name] - value).pow(2).sum()) for name, value in reference.items())
    return math.sqrt(difference / sum(float(value.pow(2).sum()) for value in reference.values()))


@pytest.mark.parametrize("case", sorted(RANDOM_FORWARDS))
def test_with_random_forwards_the_step_is_the_gradient_of_the_loss_it_computed(case, clip_tokenizer):
    """Dropout and noise on: 4 + 4 accumulated gives the loss of the no-grad pass and exactly the gradient of that
    loss (the reference back-propagates it through one graph with the same draws). Without the replay the gradient is
    another one (the draws matter: this test can fail)."""
    steps = _random_steps(case, clip_tokenizer)
    (loss, grads), (reference_loss, reference), (_, unreplayed) = (steps[m] for m in ("replayed", "graph", "unreplayed"))
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert sorted(grads) == sorted(reference) and reference
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert _distance(unreplayed, reference) > 1e-3, "no randomness reached the gradient"


@pytest.fixture(scope="module", params=REPRESENTATIVE_MATRIX)  # every method under -m slow
def method_runs(request, tmp_path_factory):
    """A method's two-task run of 32 x 2 and of 64 x 1 (2 SGD steps per task), with their logs, by batch size."""
    method = request.param
    if method in PAIR_ONLY:
        pytest.skip("pair tasks train one micro-batch per step; accumulation is refused (test_pair_tasks)")
    sgd = {"learning_rate": 0.5, "optim": "sgd", "weight_decay": 0.0, "lr_scheduler_type": "constant",
           "warmup_steps": 0}
    folder = tmp_path_factory.mktemp(method)
    runs = {}
    for batch, steps in ((32, 2), (64, 1)):
        recorder = LogRecorder()
        training = {**sgd, "per_device_train_batch_size": batch, "gradient_accumulation_steps": steps}
        learner = run_method(method, folder / f"{batch}x{steps}", training, samples_per_task=128,
                             callbacks=[recorder])
        runs[batch] = (learner, recorder)
    return method, runs


def test_every_method_trains_the_same_with_32x2_as_with_64x1(method_runs):
    """Two tasks with 2 SGD steps each: every parameter and every logged loss term of the first step of the second
    task (where the teachers, penalties, buffers and queues are live) agree; the first loss is ln 64, not ln 32."""
    _, runs = method_runs
    (accumulated, accumulated_logs), (whole, whole_logs) = runs[32], runs[64]
    first_loss = accumulated_logs.first_step(0).get("loss/contrastive")
    if first_loss is not None:  # a random CLIP scores near uniformly: the loss starts at ln(batch)
        assert first_loss == pytest.approx(math.log(64), abs=0.1)
    for task in (0, 1):
        mine, theirs = accumulated_logs.first_step(task), whole_logs.first_step(task)
        terms = sorted(key for key in theirs if key.startswith("loss"))
        assert sorted(key for key in mine if key.startswith("loss")) == terms
        for key in terms:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (task, key)
    seen = [c.samples_seen for c in accumulated.compute]
    assert seen == [c.samples_seen for c in whole.compute] and seen[0] == 128  # (oracle trains t x C)
    for (name, mine), theirs in zip(accumulated.model.named_parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4, msg=name)


def test_every_methods_checkpoint_loads_as_the_model_it_scored_the_way_its_card_says(method_runs):
    """(Reusing the run above.) The last task's checkpoint, loaded as its model card says, scores exactly the run's
    last row: with plain transformers (`AutoModel.from_pretrained`), or, for a method that keeps part of the model in
    its state, with the loader it declares (`checkpoint_loader`), which the card then names. A new method whose
    checkpoint drops state fails here until it declares its loader."""
    import importlib

    from transformers import AutoModel

    from hf_ccl.evaluation import evaluate_task
    from hf_ccl.methods import METHODS

    method, runs = method_runs
    learner = runs[64][0]
    folder = learner.save_checkpoint(1)
    card = (folder / "README.md").read_text(encoding="utf-8")
    loader = METHODS[method].checkpoint_loader
    if loader is None:
        model = AutoModel.from_pretrained(folder)
        assert "is not this revision's weights alone" not in card
    else:
        model = getattr(importlib.import_module(loader.module), loader.function)(folder)
        assert f"from {loader.module} import {loader.function}" in card
    images = random_image_inputs(learner.model, 4)
    texts = learner.tokenizer(["a photo of a seven", "two dogs"], padding=True, return_tensors="pt")
    learner.model.eval()
    with torch.no_grad():
        for mine, theirs in ((model.get_image_features(**images), learner.model.get_image_features(**images)),
                             (model.get_text_features(**texts), learner.model.get_text_features(**texts))):
            torch.testing.assert_close(mine.pooler_output, theirs.pooler_output, rtol=0, atol=0, msg=method)
    row = learner.results.rows[-1].metrics
    for task in learner.stream:
        scores = evaluate_task(model, task, learner.image_processor, learner.tokenizer,
                               batch_size=learner.args.evaluation.batch_size, max_length=learner.max_length)
        assert scores[task.headline_metric] == row[task.name][task.headline_metric], (method, task.name)


@pytest.mark.parametrize("methods", [["finetune"], ["er"]])
def test_cross_entropy_trains_the_same_with_32x2_as_with_64x1(tmp_path, methods):
    """The class-prompt cross-entropy (its class prompts encoded once per step, with gradients) under exact
    accumulation; with replay, rows of the earlier task are scored among their own task's classes."""
    sgd = {"learning_rate": 0.5, "optim": "sgd", "weight_decay": 0.0, "lr_scheduler_type": "constant",
           "warmup_steps": 0}
    runs = {}
    for batch, steps in ((32, 2), (64, 1)):
        recorder = LogRecorder()
        training = {**sgd, "per_device_train_batch_size": batch, "gradient_accumulation_steps": steps}
        learner = run_method(methods, tmp_path / f"{batch}x{steps}", training, samples_per_task=128,
                             callbacks=[recorder], classification_loss="cross_entropy")
        runs[batch] = (learner, recorder)
    (accumulated, accumulated_logs), (whole, whole_logs) = runs[32], runs[64]
    for task in (0, 1):
        mine, theirs = accumulated_logs.first_step(task), whole_logs.first_step(task)
        assert "loss/class_cross_entropy" in theirs and "loss/contrastive" not in theirs
        assert mine["loss/class_cross_entropy"] == pytest.approx(theirs["loss/class_cross_entropy"], rel=1e-4)
    for (name, mine), theirs in zip(accumulated.model.named_parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4, msg=name)
