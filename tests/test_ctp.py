"""CTP (paper 001): every loss term by hand, Eq. 3 and its timing, the FIFO queues, the frozen previous-task model in a
real 2-task run, state round trip and resume, and the paper-vs-code options of specs/ctp.md Sec. 7."""

import copy
import math

import pytest
import torch
from safetensors.torch import load_file

from hf_ccl.callbacks import TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream, load_image_processor
from hf_ccl.methods import TaskContext, build_methods, load_method_states, save_method_states
from hf_ccl.methods.ctp import CTP, CTPConfig
from hf_ccl.methods.ctp_losses import (
    enqueue,
    exclude_entries,
    momentum_contrast_loss,
    momentum_update,
    queue_positive_mask,
    same_item_mask,
    topology_loss,
)
from hf_ccl.modeling import ContinualCLIPModel
from hf_ccl.testing import TrainingLogRecorder, tiny_clip


def _lse(*values: float) -> float:
    return math.log(sum(math.exp(v) for v in values))


# ----- Eq. 3 ---------------------------------------------------------------------------------------------------
def test_momentum_update_by_hand():
    theta_c, theta_t, theta_prev = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 0.0])
    # Eq. 3, m = 0.9: 0.9 theta_c + 0.05 theta_{t-1} + 0.05 theta_t
    assert torch.allclose(momentum_update(theta_c, theta_t, theta_prev, 0.9), torch.tensor([1.3, 2.1]))
    # First task (no theta_{t-1}), m = 0.995: plain EMA of the current model (App. E.1)
    assert torch.allclose(momentum_update(theta_c, theta_t, None, 0.995), torch.tensor([1.01, 2.02]))
    # Tab. 3 ablations: "only theta^{t-1}" and "only theta^t"
    assert torch.allclose(momentum_update(theta_c, theta_t, theta_prev, 0.9, 1.0), torch.tensor([1.4, 1.8]))
    assert torch.allclose(momentum_update(theta_c, theta_t, theta_prev, 0.9, 0.0), torch.tensor([1.2, 2.4]))


def test_momentum_fixed_point_is_the_midpoint():
    theta_c, theta_t, theta_prev = torch.zeros(3), torch.tensor([1.0, -2.0, 4.0]), torch.tensor([3.0, 2.0, 0.0])
    for _ in range(300):
        theta_c = momentum_update(theta_c, theta_t, theta_prev, 0.9)
    assert torch.allclose(theta_c, (theta_t + theta_prev) / 2, atol=1e-6)


# ----- queues --------------------------------------------------------------------------------------------------
def test_queue_is_fifo_with_wrap_around():
    queue = torch.zeros(5, 1)
    queue, pointer = enqueue(queue, 0, torch.tensor([[1.0], [2.0], [3.0]]))
    assert queue.flatten().tolist() == [1, 2, 3, 0, 0] and pointer == 3
    queue, pointer = enqueue(queue, pointer, torch.tensor([[4.0], [5.0], [6.0]]))  # wraps: 6 overwrites 1, the oldest
    assert queue.flatten().tolist() == [6, 2, 3, 4, 5] and pointer == 1
    queue, pointer = enqueue(queue, pointer, torch.arange(10.0, 17.0)[:, None])  # 7 > K = 5: the last 5 are kept
    assert sorted(queue.flatten().tolist()) == [12, 13, 14, 15, 16]
    assert queue[pointer].item() == 12  # the pointer is at the oldest entry, the next to be overwritten
    assert queue.flatten().tolist() == [14, 15, 16, 12, 13] and pointer == 3


def test_queue_positive_mask_by_hand():
    mask = queue_positive_mask(
        torch.tensor([1, 2]), torch.tensor([10, 20]), torch.tensor([2, 0, 1]), torch.tensor([0, 10, 0])
    )
    assert mask.tolist() == [[False, True, True], [True, False, False]]


# ----- Eq. 4 ---------------------------------------------------------------------------------------------------
QUERIES = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
BATCH_KEYS = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
QUEUE_KEYS = torch.tensor([[0.0, 1.0]])


def test_momentum_contrast_by_hand():
    # tau = 0.5: row 0 logits [1, 0.6, 0] / 0.5, row 1 logits [0, 0.8, 1] / 0.5; positive of row i: column i
    row0 = _lse(2.0, 1.2, 0.0) - 2.0
    row1 = _lse(0.0, 1.6, 2.0) - 1.6
    loss = momentum_contrast_loss(QUERIES, BATCH_KEYS, QUEUE_KEYS, 0.5)
    assert math.isclose(loss.item(), (row0 + row1) / 2, rel_tol=1e-6)
    # Without a queue (Tab. 3 "w/o Q") only the batch's momentum features are contrasted.
    no_queue = ((_lse(2.0, 1.2) - 2.0) + (_lse(0.0, 1.6) - 1.6)) / 2
    assert math.isclose(momentum_contrast_loss(QUERIES, BATCH_KEYS, None, 0.5).item(), no_queue, rel_tol=1e-6)


def test_momentum_contrast_soft_targets_by_hand():
    # Both batch pairs share the text; the queued pair shares row 1's image: row 0 targets [1/2, 1/2, 0],
    # row 1 targets [1/3, 1/3, 1/3].
    positives = torch.ones(2, 2, dtype=torch.bool)
    queue_positives = torch.tensor([[False], [True]])
    row0 = _lse(2.0, 1.2, 0.0) - (2.0 + 1.2) / 2
    row1 = _lse(0.0, 1.6, 2.0) - (0.0 + 1.6 + 2.0) / 3
    loss = momentum_contrast_loss(QUERIES, BATCH_KEYS, QUEUE_KEYS, 0.5, positives, queue_positives)
    assert math.isclose(loss.item(), (row0 + row1) / 2, rel_tol=1e-6)
    identity = momentum_contrast_loss(QUERIES, BATCH_KEYS, QUEUE_KEYS, 0.5, torch.eye(2, dtype=torch.bool))
    assert torch.allclose(identity, momentum_contrast_loss(QUERIES, BATCH_KEYS, QUEUE_KEYS, 0.5))


# ----- Eq. 6-9 -------------------------------------------------------------------------------------------------
def test_cross_modal_topology_by_hand():
    similarity = torch.tensor([[1.0, 0.5], [0.2, 0.8]])
    reference = torch.tensor([[0.9, 0.1], [0.3, 0.3]])
    tau = 0.5
    rows_ce, rows_kl = [], []
    for s, r in zip(similarity.tolist(), reference.tolist(), strict=True):
        log_p = [v / tau - _lse(*(x / tau for x in s)) for v in s]
        q = [math.exp(v / tau - _lse(*(x / tau for x in r))) for v in r]
        rows_ce.append(-sum(qi * lp for qi, lp in zip(q, log_p, strict=True)))
        rows_kl.append(sum(qi * (math.log(qi) - lp) for qi, lp in zip(q, log_p, strict=True)))
    assert math.isclose(topology_loss(similarity, reference, tau).item(), sum(rows_ce) / 2, rel_tol=1e-6)
    kl = topology_loss(similarity, reference, tau, divergence="kl")
    assert math.isclose(kl.item(), sum(rows_kl) / 2, rel_tol=1e-5)
    # Row 1 in closed form: R's row is uniform, so H = lse([0.4, 1.6]) - mean([0.4, 1.6]) and KL = H - log 2.
    assert math.isclose(rows_ce[1], _lse(0.4, 1.6) - 1.0, rel_tol=1e-6)
    assert math.isclose(rows_kl[1], rows_ce[1] - math.log(2), rel_tol=1e-6)
    with pytest.raises(ValueError, match="divergence"):
        topology_loss(similarity, reference, tau, divergence="js")


def test_same_modal_topology_masks_the_diagonal_by_hand():
    similarity = torch.tensor([[1.0, 0.4, -0.2], [0.4, 1.0, 0.6], [-0.2, 0.6, 1.0]])
    reference = torch.tensor([[1.0, 0.1, 0.3], [0.1, 1.0, 0.0], [0.3, 0.0, 1.0]])
    tau = 0.1
    exclude = same_item_mask(None, 3)
    # Row 0 over the off-diagonal entries only: P = softmax([0.4, -0.2]/tau), target softmax([0.1, 0.3]/tau).
    q = [math.exp(1.0) / (math.exp(1.0) + math.exp(3.0)), math.exp(3.0) / (math.exp(1.0) + math.exp(3.0))]
    log_p = [4.0 - _lse(4.0, -2.0), -2.0 - _lse(4.0, -2.0)]
    row0 = -(q[0] * log_p[0] + q[1] * log_p[1])
    per_row = [topology_loss(similarity[i : i + 1], reference[i : i + 1], tau, exclude[i : i + 1]) for i in range(3)]
    assert math.isclose(per_row[0].item(), row0, rel_tol=1e-6)
    assert torch.isfinite(torch.stack(per_row)).all()
    probabilities = torch.softmax(exclude_entries(reference, exclude) / tau, dim=-1)  # Eq. 8's P-hat
    assert (probabilities.diagonal() == 0).all() and torch.allclose(probabilities.sum(-1), torch.ones(3))
    full = topology_loss(similarity, reference, tau, exclude, divergence="kl")
    assert torch.isfinite(full) and full > 0
    # With the diagonal masked, identical matrices give exactly zero KL (the -1000 entries have target 0, no NaN).
    assert topology_loss(reference, reference, tau, exclude, divergence="kl").abs().item() < 1e-6


def test_cross_entropy_and_kl_have_the_same_gradient():
    torch.manual_seed(0)
    reference = torch.randn(4, 4)
    exclude = same_item_mask(torch.tensor([3, 3, 5, 6]), 4)  # rows 0 and 1 are the same item: both excluded
    grads = []
    for divergence in ("cross_entropy", "kl"):
        similarity = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        topology_loss(similarity, reference, 0.07, exclude, divergence).backward()
        grads.append(similarity.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert (grads[0][exclude] == 0).all()


def test_same_item_mask():
    assert same_item_mask(torch.tensor([5, 5, 7]), 3).tolist() == [
        [True, True, False], [True, True, False], [False, False, True]
    ]
    assert torch.equal(same_item_mask(None, 3), torch.eye(3, dtype=torch.bool))


# ----- the method, step by step on real batches ------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    return stream


@pytest.fixture(scope="module")
def batches(digits, clip_tokenizer, image_processor):
    collator = CLIPCollator(image_processor, clip_tokenizer, train=True, seed=0)
    rows = [digits[1].train[i] for i in range(32)]
    return [collator(rows[:16]), collator(rows[16:])]


def _model(clip_tokenizer):
    model = tiny_clip(seed=0)
    model.align_special_tokens(clip_tokenizer)
    return model


def _context(stream, index, model, tmp_path):
    return TaskContext(task_index=index, task=stream[index], stream=stream, model=model, output_dir=tmp_path)


def _forward(method, model, inputs, context):
    outputs = model(**inputs, return_loss=True)
    return outputs, method.loss_terms(model, inputs, outputs, context)


def _step(method, model, inputs, context, optimizer):
    """One training iteration as the Trainer runs it: forward, loss terms, backward, pre-step hook, step."""
    model.train()
    outputs, terms = _forward(method, model, inputs, context)
    (outputs.loss + sum(terms.values())).backward()
    method.pre_optimizer_step(model, context)
    optimizer.step()
    optimizer.zero_grad()
    return terms


def _params(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("task_index", [0, 1])
def test_eq3_runs_after_the_optimizer_step_once_per_step(task_index, digits, batches, clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    method = CTP({"queue_size": 8})
    context = _context(digits, task_index, model, tmp_path)
    method.on_task_start(context)
    assert model.logit_scale.requires_grad is False
    assert math.isclose(model.logit_scale.item(), math.log(1 / 0.07), rel_tol=1e-6)
    theta_prev = _params(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    terms = _step(method, model, batches[0], context, optimizer)
    assert set(terms) == ({"cmc"} if task_index == 0 else {"cmc", "topology_cross", "topology_same"})
    theta_c = _params(method.momentum_model.model)
    for name, value in theta_c.items():  # at the first step F == R == M: the update is the identity
        assert torch.allclose(value, theta_prev[name], atol=1e-6), name
    theta_t = _params(model)  # F after its first optimizer step
    assert method.momentum_update_due
    model.train()
    _forward(method, model, batches[1], context)  # the next iteration: Eq. 3 on the stepped weights
    _forward(method, model, batches[1], context)  # a second micro-batch of the same step: no second update
    m = 0.995 if task_index == 0 else 0.9
    changed = 0
    for name, value in _params(method.momentum_model.model).items():
        if name == "logit_scale":
            continue
        if task_index == 0:
            expected = m * theta_c[name] + (1 - m) * theta_t[name]
        else:
            expected = m * theta_c[name] + (1 - m) / 2 * theta_prev[name] + (1 - m) / 2 * theta_t[name]
        assert torch.allclose(value, expected, atol=1e-6), name
        changed += not torch.allclose(value, theta_c[name])
    assert changed > 0
    assert all(p.grad is None and not p.requires_grad for p in method.momentum_model.parameters())


@pytest.mark.parametrize("mode", ["previous", "current"])
def test_single_way_momentum_ablations(mode, digits, batches, clip_tokenizer, tmp_path):
    """Tab. 3: "only theta^{t-1}" keeps M == R (M starts at theta_{t-1}); "only theta^t" is a plain EMA of F."""
    model = _model(clip_tokenizer)
    method = CTP({"queue_size": 0, "momentum_mode": mode})
    context = _context(digits, 1, model, tmp_path)
    method.on_task_start(context)
    theta_prev = _params(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _step(method, model, batches[0], context, optimizer)
    theta_t = _params(model)
    _step(method, model, batches[1], context, optimizer)
    for name, value in _params(method.momentum_model.model).items():
        expected = theta_prev[name] if mode == "previous" else 0.9 * theta_prev[name] + 0.1 * theta_t[name]
        assert torch.allclose(value, expected, atol=1e-6), name


def test_at_task_start_topology_is_zero_and_positives_are_own_features(digits, batches, clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    method = CTP({"queue_size": 0, "topology_divergence": "kl"})
    context = _context(digits, 1, model, tmp_path)
    method.on_task_start(context)
    model.eval()  # no momentum update, no enqueue: only the loss values
    outputs, terms = _forward(method, model, batches[0], context)
    assert terms["topology_cross"].abs().item() < 1e-5 and terms["topology_same"].abs().item() < 1e-5
    momentum_image, momentum_text = method.momentum_model.embed(batches[0])
    assert torch.allclose(momentum_image, outputs.image_embeds, atol=1e-6)
    assert torch.allclose(momentum_text, outputs.text_embeds, atol=1e-6)
    # The paper's cross-entropy differs from the code's KL by the target entropy, here that of R's own rows.
    paper = CTP({"queue_size": 0})
    paper.on_task_start(context)
    _, paper_terms = _forward(paper, model, batches[0], context)
    assert paper_terms["topology_cross"] > 1.0


def test_positive_mask_vs_diagonal(digits, batches, clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    model.eval()
    context = _context(digits, 1, model, tmp_path)
    values = {}
    for positives in ("mask", "diagonal"):
        method = CTP({"queue_size": 0, "positives": positives})
        method.on_task_start(context)
        outputs, values[positives] = _forward(method, model, batches[0], context)
        # Digits captions are class templates: duplicates are positives (mask) or negatives (diagonal, the paper).
        mask = outputs.global_positive_mask if positives == "mask" else None
        assert mask is None or mask.sum() > 16
        momentum_image, momentum_text = method.momentum_model.embed(batches[0])
        i2t = momentum_contrast_loss(outputs.image_embeds, momentum_text, None, 0.07, mask)
        t2i = momentum_contrast_loss(outputs.text_embeds, momentum_image, None, 0.07, None if mask is None else mask.t())
        assert torch.allclose(values[positives]["cmc"], (i2t + t2i) / 2, atol=1e-6)
    assert torch.allclose(values["mask"]["topology_cross"], values["diagonal"]["topology_cross"])
    assert not torch.allclose(values["mask"]["topology_same"], values["diagonal"]["topology_same"])
    unique = dict(batches[0], text_hash=torch.arange(16), image_hash=torch.arange(16) + 100)
    method = CTP({"queue_size": 0})
    method.on_task_start(context)
    unique_terms = _forward(method, model, unique, context)[1]
    for name, value in unique_terms.items():  # with unique pairs the mask is the paper's diagonal
        assert torch.allclose(value, values["diagonal"][name], atol=1e-6), name


def test_queue_takes_momentum_features_and_hashes_after_the_loss(digits, batches, clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    method = CTP({"queue_size": 24})
    context = _context(digits, 0, model, tmp_path)
    method.on_task_start(context)
    initial = method.text_queue.clone()
    assert torch.allclose(initial.norm(dim=-1), torch.ones(24))  # random unit vectors (official code)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _step(method, model, batches[0], context, optimizer)
    momentum_image, momentum_text = method.momentum_model.embed(batches[0])  # M unchanged since (no update yet)
    assert method.queue_pointer == 16
    assert torch.allclose(method.text_queue[:16], momentum_text, atol=1e-6)
    assert torch.allclose(method.image_queue[:16], momentum_image, atol=1e-6)
    assert torch.equal(method.text_queue[16:], initial[16:])
    assert torch.equal(method.text_queue_hash[:16], batches[0]["text_hash"])
    _step(method, model, batches[1], context, optimizer)  # 16 more: 8 fill the end, 8 wrap to the front
    assert method.queue_pointer == 8
    assert torch.equal(method.image_queue_hash[16:], batches[1]["image_hash"][:8])
    assert torch.equal(method.image_queue_hash[:8], batches[1]["image_hash"][8:])
    assert not method.text_queue.requires_grad


def test_state_round_trip_and_resume_gives_the_same_next_loss(digits, batches, clip_tokenizer, tmp_path):
    model = _model(clip_tokenizer)
    previous = copy.deepcopy(model)  # theta_{t-1}: the checkpoint task 1 starts from
    method = CTP({"queue_size": 20})
    context = _context(digits, 1, model, tmp_path)
    method.on_task_start(context)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _step(method, model, batches[0], context, optimizer)
    _step(method, model, batches[1], context, optimizer)
    save_method_states([method], tmp_path)
    restored = CTP({"queue_size": 20})
    restored.on_task_start(_context(digits, 1, previous, tmp_path))  # R from the checkpointed theta_{t-1}
    load_method_states([restored], tmp_path)
    assert torch.equal(restored.image_queue, method.image_queue) and restored.queue_pointer == method.queue_pointer
    assert torch.equal(restored.text_queue_hash, method.text_queue_hash)
    for name, value in _params(method.momentum_model.model).items():
        assert torch.equal(value, dict(restored.momentum_model.model.named_parameters())[name]), name
    model.train()
    _, expected = _forward(method, model, batches[0], context)
    _, resumed = _forward(restored, model, batches[0], context)
    assert set(resumed) == set(expected)
    for name in expected:
        assert torch.allclose(resumed[name], expected[name], atol=1e-6), name
    # A new task keeps the queues (spec 7.6) and re-makes M from the model it starts from (spec 7.8).
    restored.on_task_start(_context(digits, 1, model, tmp_path))
    assert torch.equal(restored.image_queue, method.image_queue)
    for name, value in _params(model).items():
        assert torch.equal(value, dict(restored.momentum_model.model.named_parameters())[name]), name


def test_config_is_validated():
    assert CTPConfig().momentum == 0.9 and CTPConfig().first_task_momentum == 0.995 and CTPConfig().queue_size == 1024
    with pytest.raises(ValueError, match="positives"):
        build_methods(["ctp"], {"ctp": {"positives": "rows"}})
    with pytest.raises(ValueError, match="momentum"):
        CTP({"momentum": 1.0})
    with pytest.raises(ValueError, match="valid options"):
        CTP({"queue": 3})
    with pytest.raises(RuntimeError, match="on_task_start"):
        CTP().loss_terms(None, {}, None, None)


# ----- a real 2-task run -----------------------------------------------------------------------------------------
def test_real_run_teacher_frozen_terms_logged_state_saved(digits, clip_tokenizer, tmp_path):
    method = CTP({"queue_size": 40})
    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={"max_steps": 3, "per_device_train_batch_size": 16, "logging_steps": 1, "learning_rate": 1e-2},
        progress=False,
    )
    class ReferenceUnchangedByTraining(TaskCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.before = _params(method.reference.model) if state.task_index == 1 else None

        def on_task_trained(self, args, state, control, **kwargs):
            if self.before is not None:
                after = _params(method.reference.model)
                assert all(torch.equal(self.before[name], after[name]) for name in self.before)

    recorder = TrainingLogRecorder()
    learner = ContinualLearner(tiny_clip(seed=0), digits, [method], load_image_processor(32), clip_tokenizer, args,
                               task_callbacks=[ReferenceUnchangedByTraining(), recorder])
    learner.fit()
    logs = [recorder.step_logs(0), recorder.step_logs(1)]
    assert logs[0] and all("loss/ctp/cmc" in log and "loss/ctp/topology_cross" not in log for log in logs[0])
    assert logs[1] and all({"loss/ctp/cmc", "loss/ctp/topology_cross", "loss/ctp/topology_same"} <= set(log)
                           for log in logs[1])
    reference = method.reference.model
    assert all(not p.requires_grad and p.grad is None for p in reference.parameters())
    task0 = ContinualCLIPModel.from_pretrained(tmp_path / "task-0")
    for name, param in reference.named_parameters():  # R is the model task 1 started from
        assert torch.equal(param, dict(task0.named_parameters())[name]), name
    assert not torch.equal(reference.text_projection.weight, learner.model.text_projection.weight)
    assert method.queue_pointer == (6 * 16) % 40
    loaded = CTP({"queue_size": 40})
    load_method_states([loaded], tmp_path / "task-1")
    assert torch.equal(loaded.text_queue, method.text_queue.cpu())
    saved = load_file(str(tmp_path / "task-1" / "method_state.safetensors"))  # M's weights are saved too
    momentum = method.momentum_model.model
    assert torch.equal(saved["ctp/momentum_model/text_projection.weight"], momentum.text_projection.weight.cpu())


def test_in_place_momentum_update_matches_eq3():
    from hf_ccl.methods.ctp_losses import momentum_update, momentum_update_

    torch.manual_seed(0)
    current, previous = [torch.randn(3, 2), torch.randn(4)], [torch.randn(3, 2), torch.randn(4)]
    for prev, share in ((previous, 0.5), (None, 0.5), (previous, 0.0), (previous, 1.0)):
        momentum = [torch.randn(3, 2), torch.randn(4)]
        expected = [
            momentum_update(c, t, None if prev is None else p, 0.9, share)
            for c, t, p in zip(momentum, current, previous, strict=True)
        ]
        momentum_update_(momentum, current, prev, 0.9, share)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(momentum, expected, strict=True))
