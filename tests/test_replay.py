"""Reservoir buffer (Algorithm R over references) and the replay methods ER, DER and DER++ on CLIP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CANONICAL_FEATURES, CLIPCollator, Task, TaskStream, build_stream, load_image_processor
from hf_ccl.data.buffer import ReservoirBuffer, reservoir_slots
from hf_ccl.losses import clip_contrastive_loss
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.replay import (
    DarkExperienceReplay,
    DarkExperienceReplayPlusPlus,
    ExperienceReplay,
    der_mse,
    subset_contrastive_loss,
)
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.testing import TrainingLogRecorder, tiny_clip


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: a fake canonical stream (no image decoding) and a small real digits stream
# ----------------------------------------------------------------------------------------------------------------
def _fake_task(name: str, n: int, captions: int = 1) -> Task:
    rows = {
        "image": [{"bytes": f"{name}-{i}".encode(), "path": None} for i in range(n)],
        "texts": [[f"{name} {i} caption {c}" for c in range(captions)] for i in range(n)],
        "image_id": [f"{name}/train/{i}" for i in range(n)],
        "label": [-1] * n,
    }
    train = Dataset.from_dict(rows, features=CANONICAL_FEATURES)
    return Task(name=name, train=train, eval=train)


@pytest.fixture
def fake_stream() -> TaskStream:
    return TaskStream("fake", [_fake_task("a", 4, captions=3), _fake_task("b", 6), _fake_task("c", 3)])


def _context(stream: TaskStream, index: int, model=None, **fields) -> TaskContext:
    return TaskContext(index, stream.tasks[index], stream, model, output_dir=None, seed=index, **fields)


@pytest.fixture(scope="module")
def digits_stream() -> TaskStream:
    stream = build_stream("digits", max_train_per_task=24, max_eval_per_task=10)
    stream.tasks = stream.tasks[:3]
    return stream


# ----------------------------------------------------------------------------------------------------------------
# Reservoir sampling
# ----------------------------------------------------------------------------------------------------------------
def _algorithm_r(capacity: int, num_seen: int, items: list, buffer: list, rng: np.random.Generator) -> list:
    """Vitter's Algorithm R written out, one draw per item past the capacity."""
    buffer = list(buffer)
    for i, item in enumerate(items, start=num_seen + 1):
        if i <= capacity:
            buffer.append(item)
        else:
            j = int(rng.integers(0, i))
            if j < capacity:
                buffer[j] = item
    return buffer


def test_reservoir_is_algorithm_r_exactly():
    buffer = ReservoirBuffer(capacity=5, seed=7)
    expected: list = []
    for task, (n, seed) in enumerate([(3, 11), (9, 12), (20, 13)]):
        rng = np.random.default_rng([7, seed, task, buffer.num_seen])
        order = rng.permutation(n)  # the seeded order the task's rows arrive in
        expected = _algorithm_r(5, buffer.num_seen, [(task, int(r)) for r in order], expected, rng)
        buffer.add_task(task, n, seed=seed)
        assert buffer.refs == expected
        assert len(buffer) == min(5, buffer.num_seen)
    assert buffer.num_seen == 32


def test_reservoir_fills_then_keeps_budget_and_reports_changed_slots():
    buffer = ReservoirBuffer(capacity=4)
    assert buffer.add_task(0, 3) == [0, 1, 2]
    assert sorted(row for _, row in buffer.refs) == [0, 1, 2]
    changed = buffer.add_task(1, 50)
    assert len(buffer) == 4 and 3 in changed
    assert all(buffer.refs[s][0] == 1 for s in changed)
    assert all(buffer.refs[s][0] == 0 for s in set(range(4)) - set(changed))
    assert ReservoirBuffer(capacity=0).add_task(0, 10) == []


def test_reservoir_is_deterministic_and_seeded():
    def run(seed: int, call_seed: int) -> list:
        buffer = ReservoirBuffer(capacity=6, seed=seed)
        for task in range(3):
            buffer.add_task(task, 10, seed=call_seed + task)
        return buffer.refs

    assert run(0, 0) == run(0, 0)
    assert run(0, 0) != run(1, 0)
    assert run(0, 0) != run(0, 5)


def test_reservoir_keeps_every_example_with_probability_budget_over_seen():
    capacity, sizes, trials = 4, (5, 7), 3000
    counts = np.zeros(sum(sizes))
    for seed in range(trials):
        buffer = ReservoirBuffer(capacity, seed=seed)
        for task, n in enumerate(sizes):
            buffer.add_task(task, n)
        for task, row in buffer.refs:
            counts[row + (sizes[0] if task else 0)] += 1
    frequency = counts / trials
    assert np.abs(frequency - capacity / sum(sizes)).max() < 0.05  # 4/12; binomial sd ~0.009


def test_reservoir_slots_discards_with_minus_one():
    slots = reservoir_slots(num_seen=0, count=10, capacity=3, rng=np.random.default_rng(0))
    assert slots[:3].tolist() == [0, 1, 2]
    assert set(slots[3:].tolist()) <= {-1, 0, 1, 2}


# ----------------------------------------------------------------------------------------------------------------
# Materialisation and state
# ----------------------------------------------------------------------------------------------------------------
def test_buffer_dataset_returns_the_referenced_rows(fake_stream):
    buffer = ReservoirBuffer(capacity=5, seed=3)
    buffer.add_task(0, 4)
    buffer.add_task(1, 6)
    rows = buffer.dataset(fake_stream)
    names = "abc"
    assert rows["image_id"] == [f"{names[t]}/train/{r}" for t, r in buffer.refs]
    assert rows.features == CANONICAL_FEATURES and "buffer_slot" not in rows.column_names
    captions = [2 if task == 0 else 0 for task, _ in buffer.refs]  # task a has 3 captions per row, b one
    picked = buffer.dataset(fake_stream, slots=[4, 1], slot_column="buffer_slot", caption_index=captions)
    assert picked["buffer_slot"] == [4, 1]
    for row, slot in zip(picked, [4, 1], strict=True):
        task, index = buffer.refs[slot]
        assert row["image_id"] == f"{names[task]}/train/{index}"
        assert row["texts"] == [fake_stream.tasks[task].train[index]["texts"][captions[slot]]]
    with pytest.raises(ValueError, match="does not have"):
        buffer.dataset(TaskStream("short", fake_stream.tasks[:1]))


def test_buffer_state_round_trip():
    buffer = ReservoirBuffer(capacity=3, seed=2)
    buffer.add_task(0, 5, seed=1)
    restored = ReservoirBuffer.from_state_dict(buffer.state_dict())
    assert restored.refs == buffer.refs and restored.num_seen == 5 and restored.seed == 2
    buffer.add_task(1, 4, seed=9)
    restored.add_task(1, 4, seed=9)
    assert restored.refs == buffer.refs


def test_collator_passes_buffer_slot_through(digits_stream, clip_tokenizer):
    collator = CLIPCollator(load_image_processor(32), clip_tokenizer)
    rows = [digits_stream.tasks[0].train[i] for i in range(3)]
    assert "buffer_slot" not in collator(rows)
    rows = [{**rows[0], "buffer_slot": 4}, {**rows[1], "buffer_slot": None}, rows[2]]
    batch = collator(rows)
    assert batch["buffer_slot"].dtype == torch.int64 and batch["buffer_slot"].tolist() == [4, -1, -1]


# ----------------------------------------------------------------------------------------------------------------
# ER
# ----------------------------------------------------------------------------------------------------------------
def test_er_trains_on_task_plus_buffer(fake_stream):
    er = ExperienceReplay({"buffer_size": 5})
    sizes = []
    for index, task in enumerate(fake_stream):
        context = _context(fake_stream, index)
        sizes.append(len(er.train_dataset(context, task.train)))
        er.on_task_end(context)
    assert sizes == [4, 6 + 4, 3 + 5]
    assert len(er.buffer) == 5 and er.buffer.num_seen == 13


# ----------------------------------------------------------------------------------------------------------------
# DER and DER++
# ----------------------------------------------------------------------------------------------------------------
def test_der_mse_by_hand():
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    texts = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.8, 0.6]])
    image_targets = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # slot 0, slot 1
    text_targets = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    slots = torch.tensor([-1, 1, 0])  # row 0 is new data
    # row 1 vs slot 1: image (0,1)-(0,0) -> mean 0.5; text (1,0)-(1,1) -> mean 0.5
    # row 2 vs slot 0: image (0.6,0.8)-(1,0) -> (0.16+0.64)/2 = 0.4; text (0.8,0.6)-(0,0) -> (0.64+0.36)/2 = 0.5
    expected = (0.5 + 0.5 + 0.4 + 0.5) / (2 * 2)
    assert der_mse(images, texts, image_targets, text_targets, slots).item() == pytest.approx(expected)
    assert der_mse(images, texts, image_targets, text_targets, torch.tensor([-1, -1, -1])).item() == 0.0


def test_subset_contrastive_is_the_clip_loss_of_the_buffer_rows():
    torch.manual_seed(0)
    logits = torch.randn(5, 5) * 10
    positives = torch.eye(5, dtype=torch.bool)
    positives[1, 3] = positives[3, 1] = True  # a duplicate caption among the buffer rows
    rows = torch.tensor([False, True, True, True, False])
    keep = rows.nonzero().flatten()
    expected = clip_contrastive_loss(logits[keep][:, keep], positives[keep][:, keep])
    assert subset_contrastive_loss(logits, positives, rows).item() == pytest.approx(expected.item(), rel=1e-6)
    assert subset_contrastive_loss(logits, None, torch.zeros(5, dtype=torch.bool)).item() == 0.0


def _der_after_first_task(method_class, digits_stream, tokenizer, **config):
    model = tiny_clip(seed=0)
    model.align_special_tokens(tokenizer)
    processor = load_image_processor(32)
    method = method_class({"buffer_size": 10, **config})
    eval_collator = CLIPCollator(processor, tokenizer, train=False)
    context = _context(digits_stream, 0, model, collator=eval_collator, per_device_batch_size=4)
    method.on_task_end(context)
    next_context = _context(digits_stream, 1, model)
    dataset = method.train_dataset(next_context, digits_stream.tasks[1].train)
    return model, method, next_context, dataset, CLIPCollator(processor, tokenizer, train=True)


def _mixed_batch(dataset, collator, n_buffer=6, n_new=4):
    new = [dataset[i] for i in range(n_new)]  # the task's own rows come first in the concatenation
    replay = [dataset[len(dataset) - 1 - i] for i in range(n_buffer)]
    return collator(new + replay)


def test_der_records_embeddings_and_its_loss_is_zero_until_the_model_changes(digits_stream, clip_tokenizer):
    model, der, context, dataset, collator = _der_after_first_task(DarkExperienceReplay, digits_stream, clip_tokenizer)
    assert der.image_targets.shape == (10, 32) and der.text_targets.shape == (10, 32)
    assert torch.allclose(der.image_targets.norm(dim=-1), torch.ones(10))
    assert len(dataset) == 24 + 10 and dataset["buffer_slot"][:24] == [None] * 24
    batch = _mixed_batch(dataset, collator)
    assert (batch["buffer_slot"] >= 0).sum() == 6
    model.train()
    terms = der.loss_terms(model, batch, model(**batch, return_loss=True), context)
    assert set(terms) == {"mse"} and terms["mse"].item() < 1e-10  # the model is the one that recorded them
    with torch.no_grad():
        model.visual_projection.weight.add_(0.05 * torch.randn_like(model.visual_projection.weight))
    outputs = model(**batch, return_loss=True)
    terms = der.loss_terms(model, batch, outputs, context)
    slots = batch["buffer_slot"]
    keep = slots >= 0
    by_hand = 0.5 * (
        (outputs.image_embeds[keep] - der.image_targets[slots[keep]]).pow(2).mean()
        + (outputs.text_embeds[keep] - der.text_targets[slots[keep]]).pow(2).mean()
    )
    assert terms["mse"].item() > 1e-6 and terms["mse"].item() == pytest.approx(by_hand.item(), rel=1e-5)
    terms["mse"].backward()
    assert model.visual_projection.weight.grad.abs().sum() > 0


def test_derpp_adds_the_contrastive_loss_of_the_buffer_rows(digits_stream, clip_tokenizer):
    model, derpp, context, dataset, collator = _der_after_first_task(
        DarkExperienceReplayPlusPlus, digits_stream, clip_tokenizer, alpha=0.5, beta=2.0
    )
    batch = _mixed_batch(dataset, collator)
    outputs = model(**batch, return_loss=True)
    terms = derpp.loss_terms(model, batch, outputs, context)
    keep = (batch["buffer_slot"] >= 0).nonzero().flatten()
    expected = clip_contrastive_loss(
        outputs.global_logits_per_image[keep][:, keep], outputs.global_positive_mask[keep][:, keep]
    )
    assert set(terms) == {"mse", "replay_contrastive"}
    assert terms["replay_contrastive"].item() == pytest.approx(2.0 * expected.item(), rel=1e-5)
    new_only = collator([dataset[i] for i in range(4)])  # no buffer row: both terms are exactly 0
    terms = derpp.loss_terms(model, new_only, model(**new_only, return_loss=True), context)
    assert all(value.item() == 0.0 for value in terms.values())


def test_der_keeps_one_recorded_caption_per_slot(clip_tokenizer):
    stream = TaskStream("fake", [_fake_task("a", 4, captions=3), _fake_task("b", 2)])
    der = DarkExperienceReplay({"buffer_size": 3})
    der.update_buffer(_context(stream, 0))
    der._choose_captions(_context(stream, 0), [0, 1, 2])
    rows = der.replay_dataset(_context(stream, 1))
    for row, (task, index) in zip(rows, der.buffer.refs, strict=True):
        assert row["texts"] == [stream.tasks[task].train[index]["texts"][der.captions[row["buffer_slot"]]]]


def test_der_state_round_trip(tmp_path, digits_stream, clip_tokenizer):
    _, der, _, _, _ = _der_after_first_task(DarkExperienceReplayPlusPlus, digits_stream, clip_tokenizer)
    save_method_states([der], tmp_path)
    assert (tmp_path / "method_state.safetensors").exists()
    restored = DarkExperienceReplayPlusPlus({"buffer_size": 10})
    load_method_states([restored], tmp_path)
    assert restored.buffer.refs == der.buffer.refs and restored.buffer.num_seen == der.buffer.num_seen
    assert restored.captions == der.captions
    assert torch.equal(restored.image_targets, der.image_targets)
    assert torch.equal(restored.text_targets, der.text_targets)
    (tmp_path / "empty").mkdir()
    save_method_states([ExperienceReplay({"buffer_size": 4})], tmp_path / "empty")
    again = ExperienceReplay({"buffer_size": 4})
    load_method_states([again], tmp_path / "empty")
    assert len(again.buffer) == 0 and again.buffer.capacity == 4


# ----------------------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method_class", [ExperienceReplay, DarkExperienceReplayPlusPlus])
def test_three_task_digits_run(tmp_path, digits_stream, clip_tokenizer, method_class):
    method = method_class({"buffer_size": 16})
    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={"max_steps": 3, "per_device_train_batch_size": 16, "logging_steps": 1},
        evaluation={"initial": False},
        progress=False,
    )
    recorder = TrainingLogRecorder()
    learner = ContinualLearner(tiny_clip(seed=0), digits_stream, [method], load_image_processor(32), clip_tokenizer, args,
                               task_callbacks=[recorder])
    results = learner.fit()
    logs = [recorder.step_logs(index) for index in range(3)]
    assert results.num_trained == 3
    assert len(method.buffer) == 16 and method.buffer.num_seen == 3 * 24
    assert set(method.buffer.task_counts()) <= {0, 1, 2}
    if isinstance(method, DarkExperienceReplay):
        assert method.image_targets.shape == (16, 32)
        assert all("loss/derpp/mse" in log and "loss/derpp/replay_contrastive" in log for task in logs for log in task)
        assert max(log["loss/derpp/replay_contrastive"] for log in logs[2]) > 0
    restored = method_class({"buffer_size": 16})
    load_method_states([restored], tmp_path / "task-2")
    assert restored.buffer.refs == method.buffer.refs
