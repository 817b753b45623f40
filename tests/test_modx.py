"""Mod-X (paper 000): Eq. 3 row selection, Eq. 4 KL, paper vs code variants, positives, and the teacher in a real run."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream, load_image_processor
from hf_ccl.losses import positive_mask
from hf_ccl.methods import TaskContext, build_methods, load_method_states, save_method_states
from hf_ccl.methods.distillation import modx_keep_mask, similarity_kl
from hf_ccl.methods.modx import ModX, ModXConfig, modx_kl
from hf_ccl.testing import tiny_clip


def kl_to_uniform(row):
    """KL(softmax(row) || uniform) in plain Python: sum_j p_j log(n p_j)."""
    exps = [math.exp(x) for x in row]
    total = sum(exps)
    return sum(e / total * math.log(len(row) * e / total) for e in exps)


# Teacher similarities (image rows, text columns): row 1's argmax is column 0 (the teacher is wrong on image 1);
# every column's argmax is its own row (the teacher is right on every text).
OLD = torch.tensor([[0.9, 0.1, 0.0], [0.8, 0.2, 0.1], [0.0, 0.1, 0.7]])


def test_similarity_kl_two_rows_by_hand():
    old = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    new = torch.zeros(2, 2)
    a = math.e / (1 + math.e)  # softmax([1, 0])[0]
    row = a * math.log(2 * a) + (1 - a) * math.log(2 * (1 - a))  # KL(p || [1/2, 1/2])
    assert row == pytest.approx(0.110945, abs=1e-6)
    assert float(similarity_kl(old, new, reduction="sum")) == pytest.approx(2 * row, abs=1e-6)
    assert float(similarity_kl(old, new, reduction="batchmean")) == pytest.approx(row, abs=1e-6)
    b = 1 / (1 + math.exp(-0.5))  # temperature 2: softmax([0.5, 0])[0]
    row_t2 = b * math.log(2 * b) + (1 - b) * math.log(2 * (1 - b))
    assert float(similarity_kl(old, new, temperature=2.0)) == pytest.approx(2 * row_t2, abs=1e-6)
    assert float(similarity_kl(old, old.clone())) == pytest.approx(0.0, abs=1e-7)


def test_keep_mask_and_replaced_rows_give_zero_loss_and_gradient():
    assert modx_keep_mask(OLD).tolist() == [True, False, True]
    assert modx_keep_mask(OLD.t()).tolist() == [True, True, True]
    new = torch.zeros(3, 3, requires_grad=True)
    loss = similarity_kl(OLD, new, modx_keep_mask(OLD), reduction="sum")
    expected = kl_to_uniform([0.9, 0.1, 0.0]) + kl_to_uniform([0.0, 0.1, 0.7])  # row 1 dropped
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert torch.equal(new.grad[1], torch.zeros(3))  # the replaced row: exactly no gradient
    assert new.grad[0].abs().sum() > 0 and new.grad[2].abs().sum() > 0


def _code_loss(old, new):
    """The official code (continue_train_model.py): cognition_align row replacement, softmax at T=1 on raw
    cosines, F.kl_div(..., reduction='sum') per direction, averaged."""

    def cognition_align(old_matrix, new_matrix):
        old_matrix = old_matrix.clone()
        index = torch.max(old_matrix, 1)[1]
        for i in range(old_matrix.shape[0]):
            if index[i] != i:
                old_matrix[i] = new_matrix[i]
        return old_matrix

    i2t = F.kl_div(new.softmax(-1).log(), cognition_align(old, new).softmax(-1), reduction="sum")
    t2i = F.kl_div(new.t().softmax(-1).log(), cognition_align(old.t(), new.t()).softmax(-1), reduction="sum")
    return (i2t + t2i) / 2


def test_code_variant_matches_the_official_code_in_value_and_gradient():
    torch.manual_seed(0)
    images, texts = F.normalize(torch.randn(12, 8), dim=-1), F.normalize(torch.randn(12, 8), dim=-1)
    old = images @ texts.t()
    old = old + 2.0 * torch.eye(12) * (torch.arange(12) % 3 != 0)  # the teacher is right on 2 rows out of 3
    student = F.normalize(torch.randn(12, 8), dim=-1).requires_grad_()
    ours, keep = modx_kl(old, student @ texts.t(), None, ["i2t", "t2i"], 1.0, "sum", selection="diagonal")
    (grad_ours,) = torch.autograd.grad(ours, student)
    reference = _code_loss(old, student @ texts.t())
    (grad_reference,) = torch.autograd.grad(reference, student)
    assert 0 < int(keep["i2t"].sum()) < 12
    assert float(ours.detach()) == pytest.approx(float(reference.detach()), rel=1e-5)
    assert torch.allclose(grad_ours, grad_reference, atol=1e-6)


def test_paper_and_code_variants_pinned():
    paper, code = ModXConfig(), ModXConfig(variant="code")
    keys = ("kd_temperature", "reduction", "directions", "selection")
    assert [paper.resolved(k) for k in keys] == [1.0, "sum", ["i2t", "t2i"], "positives"]
    assert [code.resolved(k) for k in keys] == [1.0, "sum", ["i2t", "t2i"], "diagonal"]
    assert ModXConfig(variant="code", directions=["t2i"], reduction="batchmean").resolved("directions") == ["t2i"]
    assert ModXConfig(variant="code", selection="positives").resolved("selection") == "positives"
    assert paper.alpha == 20.0 and paper.teacher_cache is False
    with pytest.raises(ValueError, match="variant"):
        ModXConfig(variant="official")
    with pytest.raises(ValueError, match="directions"):
        ModXConfig(directions=["i2t", "i2t"])

    new = torch.zeros(3, 3)
    rows = [kl_to_uniform(r) for r in OLD.tolist()]
    columns = [kl_to_uniform(c) for c in OLD.t().tolist()]
    one_matrix, _ = modx_kl(OLD, new, None, ["i2t"], 1.0, "sum")  # Eq. 4 to the letter: image rows only
    both, _ = modx_kl(OLD, new, None, ["i2t", "t2i"], 1.0, "sum")  # the default of both variants
    assert float(one_matrix) == pytest.approx(rows[0] + rows[2], abs=1e-6)  # image rows, row 1 dropped
    assert float(both) == pytest.approx(0.5 * (rows[0] + rows[2] + sum(columns)), abs=1e-6)


def test_positive_mask_selection_with_duplicate_texts():
    # Texts 0 and 1 are the same caption: the teacher's text embeddings tie, so image 1's argmax is column 0.
    texts = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    images = F.normalize(texts + 0.1 * torch.tensor([[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0]]), dim=-1)
    old = images @ texts.t()
    mask = positive_mask(torch.tensor([7, 7, 8, 9]), torch.arange(4))
    assert modx_keep_mask(old).tolist() == [True, False, True, True]  # Eq. 3 literally: image 1 counts as wrong
    assert modx_keep_mask(old, mask).tolist() == [True, True, True, True]  # a duplicate of its own text is right
    # And through the method (paper variant, alpha 20): the kept fraction and the loss follow `selection`.
    # Student text embeddings 0, so M_t = 0 and every row's KL is KL(p_old || uniform).
    outputs = SimpleNamespace(all_image_embeds=images, all_text_embeds=torch.zeros(4, 3), global_positive_mask=mask)
    fractions, losses = {}, {}
    for selection in ("positives", "diagonal", "none"):
        method = _method_with_fixed_teacher(images, texts, selection=selection)
        losses[selection] = float(method.loss_terms(torch.nn.Linear(1, 1), {}, outputs, None)["kl"].detach())
        fractions[selection] = method.metrics()["kept_fraction"]
    per_row = [kl_to_uniform(r) for r in old.tolist()]
    assert fractions == {"positives": 1.0, "diagonal": 0.75, "none": 1.0}
    assert losses["positives"] == pytest.approx(20.0 * sum(per_row), rel=1e-5)
    assert losses["diagonal"] == pytest.approx(20.0 * (sum(per_row) - per_row[1]), rel=1e-5)
    assert losses["none"] == pytest.approx(losses["positives"], rel=1e-6)


def _method_with_fixed_teacher(images, texts, **config):
    method = ModX(config)
    method.teacher = object()  # any non-None teacher; its embeddings are fixed below
    method.teacher_embeddings = lambda model, inputs: (images, texts)
    return method


def _context(model, stream, index):
    return TaskContext(task_index=index, task=stream[index], stream=stream, model=model, output_dir=".")


@pytest.fixture(scope="module")
def digits_batch(clip_tokenizer, image_processor):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    collator = CLIPCollator(image_processor, clip_tokenizer, train=True, seed=0)
    return stream, collator([stream[1].train[i] for i in range(16)])


def test_no_teacher_on_task_0_and_zero_kl_when_student_equals_teacher(digits_batch, clip_tokenizer):
    stream, batch = digits_batch
    model = tiny_clip(seed=0)
    model.align_special_tokens(clip_tokenizer)
    method = ModX({"variant": "code"})
    method.on_task_start(_context(model, stream, 0))
    outputs = model(**batch, return_loss=True)
    assert method.teacher is None and method.loss_terms(model, batch, outputs, None) == {} and method.metrics() == {}
    method.on_task_start(_context(model, stream, 1))
    (term,) = method.loss_terms(model, batch, model(**batch, return_loss=True), None).values()
    assert abs(float(term.detach())) < 1e-5  # at the first step of a task the student is the teacher (spec §11.5a)
    assert 0.0 < method.metrics()["kept_fraction"] <= 1.0


def test_teacher_cache_gives_the_same_loss_and_state_round_trip(digits_batch, clip_tokenizer, tmp_path):
    stream, batch = digits_batch
    model = tiny_clip(seed=0)
    model.align_special_tokens(clip_tokenizer)
    teacher_model = tiny_clip(seed=1)
    teacher_model.align_special_tokens(clip_tokenizer)
    cached, plain = ModX({"teacher_cache": True, "variant": "code"}), ModX({"variant": "code"})
    for method in (cached, plain):
        method.on_task_start(_context(teacher_model, stream, 1))
    outputs = model(**batch, return_loss=True)
    reference = float(plain.loss_terms(model, batch, outputs, None)["kl"].detach())
    assert reference > 0
    for _ in range(2):  # the second call reads every embedding from the cache
        # The cache encodes each unique example once, in batches of another shape than the plain teacher's: float32
        # matmuls re-associate, so embeddings agree to ~1e-7 and the KL (a sum over 2 x N rows of tiny values) to
        # ~1e-7 absolute, far from its relative 1e-5.
        for mine, theirs in zip(cached.teacher.embed(batch), plain.teacher.embed(batch), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        assert float(cached.loss_terms(model, batch, outputs, None)["kl"].detach()) == pytest.approx(reference, abs=1e-5)
    assert cached.teacher.encoded_images == len(set(batch["image_hash"].tolist()))
    # The state is empty (the teacher is re-snapshotted at task start): a resumed method gives the same loss.
    save_method_states([plain], tmp_path)
    (resumed,) = build_methods(["modx"], {"modx": {"variant": "code"}})
    load_method_states([resumed], tmp_path)
    assert plain.state_dict() == {} and resumed.teacher is None
    resumed.on_task_start(_context(teacher_model, stream, 1))
    assert float(resumed.loss_terms(model, batch, outputs, None)["kl"].detach()) == pytest.approx(reference, rel=1e-6)


class _Probe(ModX):
    """Mod-X that records its teacher at each task end, before it is released."""

    def __init__(self, config=None):
        super().__init__(config)
        self.records = []

    def on_task_end(self, context):
        teacher = self.teacher
        self.records.append({
            "teacher": None if teacher is None else {k: v.clone() for k, v in teacher.model.state_dict().items()},
            "frozen": teacher is None or (
                not teacher.model.training and all(not p.requires_grad and p.grad is None for p in teacher.parameters())
            ),
            "student": {k: v.detach().clone() for k, v in context.model.state_dict().items()},
            "log": context.log_history,
        })
        super().on_task_end(context)


def test_teacher_is_frozen_and_unchanged_in_a_real_run(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]
    probe = _Probe({"variant": "code"})
    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={"max_steps": 3, "per_device_train_batch_size": 16, "logging_steps": 1, "learning_rate": 1e-3},
        progress=False,
    )
    ContinualLearner(tiny_clip(seed=0), stream, [probe], load_image_processor(32), clip_tokenizer, args).fit()
    first, second = probe.records
    assert first["teacher"] is None and probe.teacher is None
    assert all("loss/modx/kl" not in log and "modx/kept_fraction" not in log for log in first["log"])
    # Task 1's teacher is exactly the model after task 0, after 3 steps of training the student, and frozen.
    assert second["frozen"]
    assert all(torch.equal(second["teacher"][k], first["student"][k]) for k in first["student"])
    assert any(not torch.equal(second["student"][k], first["student"][k]) for k in first["student"])
    step_logs = [log for log in second["log"] if "loss" in log]
    assert step_logs and all("loss/modx/kl" in log and "modx/kept_fraction" in log for log in step_logs)
    assert all(0.0 <= log["modx/kept_fraction"] <= 1.0 for log in step_logs)
    saved = (tmp_path / "task-1" / "method_state.json").read_text()
    assert '"variant": "code"' in saved
