"""LwF in the contrastive form: hand-computed KL over both directions, each model's own logit scale, no row
selection, and the shared teacher handling in a real 2-task run."""

import math
from types import SimpleNamespace

import pytest
import torch

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream, load_image_processor
from hf_ccl.methods import TaskContext, build_methods, load_method_states, save_method_states
from hf_ccl.methods.distillation import TeacherMethod
from hf_ccl.methods.lwf import LwF, LwFConfig, lwf_kl
from hf_ccl.testing import tiny_clip


def kl_two(x):
    """KL(softmax([x, 0]) || [1/2, 1/2]) in plain Python."""
    a = 1 / (1 + math.exp(-x))
    return a * math.log(2 * a) + (1 - a) * math.log(2 * (1 - a))


def test_lwf_kl_both_directions_by_hand():
    old = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    new = torch.zeros(2, 2)
    # T = 2. i2t rows [1, 0] and [0.5, 0]; t2i rows (columns) [1, 0.5] and [0, 0]. batchmean = mean over rows.
    i2t = (kl_two(1.0) + kl_two(0.5)) / 2
    t2i = (kl_two(0.5) + 0.0) / 2
    assert float(lwf_kl(old, new, ["i2t"], 2.0)) == pytest.approx(i2t, abs=1e-6)
    assert float(lwf_kl(old, new, ["t2i"], 2.0)) == pytest.approx(t2i, abs=1e-6)
    assert float(lwf_kl(old, new, ["i2t", "t2i"], 2.0)) == pytest.approx((i2t + t2i) / 2, abs=1e-6)
    assert float(lwf_kl(old, new, ["i2t"], 2.0, "sum")) == pytest.approx(2 * i2t, abs=1e-6)


def test_defaults_and_validation():
    config = LwFConfig()
    assert (config.alpha, config.temperature, config.logits, config.reduction) == (1.0, 2.0, "scaled", "batchmean")
    assert config.directions == ["i2t", "t2i"] and config.teacher_cache is False
    with pytest.raises(ValueError, match="logits"):
        LwFConfig(logits="raw")
    with pytest.raises(ValueError, match="temperature"):
        LwFConfig(temperature=0.0)
    assert isinstance(LwF(), TeacherMethod)


def test_scaled_logits_use_each_models_scale_and_no_row_is_dropped():
    # The teacher is wrong on image 1 (its argmax is text 0): Mod-X would drop that row, LwF keeps it.
    old_images = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    texts = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    student = torch.nn.Linear(1, 1)  # only `.training` is read from the model
    scale = torch.nn.Parameter(torch.tensor(math.log(3.0)))
    method = LwF({"directions": ["i2t"], "alpha": 2.0})
    method.teacher = SimpleNamespace(model=SimpleNamespace(logit_scale=torch.tensor(math.log(4.0))))
    method.teacher_embeddings = lambda model, inputs: (old_images, texts)
    new_images = torch.zeros(2, 2)
    outputs = SimpleNamespace(
        all_image_embeds=new_images, all_text_embeds=texts, global_logits_per_image=scale.exp() * new_images @ texts.t()
    )
    (term,) = method.loss_terms(student, {}, outputs, None).values()
    # Teacher logits 4 * [[1, 0], [1, 0]] / T=2 -> rows [2, 0]; student logits 3 * 0 -> uniform.
    assert float(term.detach()) == pytest.approx(2.0 * kl_two(2.0), abs=1e-6)
    term.backward()  # the student's logit scale is in the graph (it multiplies M_t)
    assert scale.grad is not None
    cosine = LwF({"directions": ["i2t"], "logits": "cosine", "temperature": 1.0})
    cosine.teacher, cosine.teacher_embeddings = method.teacher, method.teacher_embeddings
    assert float(cosine.loss_terms(student, {}, outputs, None)["kl"].detach()) == pytest.approx(kl_two(1.0), abs=1e-6)


def _context(model, stream, index):
    return TaskContext(task_index=index, task=stream[index], stream=stream, model=model, output_dir=".")


def test_teacher_cache_state_and_task_0(clip_tokenizer, image_processor, tmp_path):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    batch = CLIPCollator(image_processor, clip_tokenizer, train=True, seed=0)([stream[1].train[i] for i in range(16)])
    model, teacher_model = tiny_clip(seed=0), tiny_clip(seed=1)
    for m in (model, teacher_model):
        m.align_special_tokens(clip_tokenizer)
    outputs = model(**batch, return_loss=True)
    plain, cached = LwF(), LwF({"teacher_cache": True})
    plain.on_task_start(_context(teacher_model, stream, 0))
    assert plain.teacher is None and plain.loss_terms(model, batch, outputs, None) == {}
    for method in (plain, cached):
        method.on_task_start(_context(teacher_model, stream, 1))
    reference = float(plain.loss_terms(model, batch, outputs, None)["kl"].detach())
    assert reference > 0
    for _ in range(2):  # the second call reads every embedding from the cache
        # The cache encodes each unique example once, in batches of another shape than the plain teacher's: float32
        # matmuls re-associate, so embeddings agree to ~1e-7, and the KL (~4e-4, a difference of near-equal sums over
        # 2 x N rows) to ~5e-8 absolute, which is over 1e-4 of its own size: compare at float32 tolerance.
        for mine, theirs in zip(cached.teacher.embed(batch), plain.teacher.embed(batch), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert float(cached.loss_terms(model, batch, outputs, None)["kl"].detach()) == pytest.approx(reference, abs=1e-6)
    save_method_states([plain], tmp_path)
    (resumed,) = build_methods(["lwf"])
    load_method_states([resumed], tmp_path)
    resumed.on_task_start(_context(teacher_model, stream, 1))
    assert float(resumed.loss_terms(model, batch, outputs, None)["kl"].detach()) == pytest.approx(reference, rel=1e-6)


class _Probe(LwF):
    def __init__(self, config=None):
        super().__init__(config)
        self.records = []

    def on_task_end(self, context):
        teacher = self.teacher
        self.records.append({
            "teacher": None if teacher is None else [p.detach().clone() for p in teacher.parameters()],
            "frozen": teacher is None or (not teacher.model.training and not any(p.requires_grad for p in teacher.parameters())),
            "student": [p.detach().clone() for p in context.model.parameters()],
            "log": context.log_history,
        })
        super().on_task_end(context)


def test_teacher_is_frozen_and_unchanged_in_a_real_run(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    probe = _Probe()
    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={"max_steps": 3, "per_device_train_batch_size": 16, "logging_steps": 1, "learning_rate": 1e-3},
        progress=False,
    )
    ContinualLearner(tiny_clip(seed=0), stream, [probe], load_image_processor(32), clip_tokenizer, args).fit()
    first, second = probe.records
    assert first["teacher"] is None and probe.teacher is None
    assert all("loss/lwf/kl" not in log for log in first["log"])
    assert second["frozen"]
    assert all(torch.equal(t, s) for t, s in zip(second["teacher"], first["student"], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(second["student"], first["student"], strict=True))
    step_logs = [log for log in second["log"] if "loss" in log]
    assert step_logs and all(log["loss/lwf/kl"] >= 0 for log in step_logs)
