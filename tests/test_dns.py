"""DNS (Dual-sided Null Space, specs/cmcl.md §2): the projection math, the method's hooks, a tiny 2-task run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.dns import DNS
from hf_ccl.methods.projection import (
    dual_null_space_projection,
    kept_eigenvalues,
    merge_second_moment,
    null_space_projector,
    second_moment,
    uncentered_covariance_update,
)
from hf_ccl.methods.state import load_method_states, save_method_states

DOUBLE = torch.float64


def _low_rank(rows: int, dim: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=generator, dtype=DOUBLE) @ torch.randn(
        rank, dim, generator=generator, dtype=DOUBLE
    )


# ----- covariance ---------------------------------------------------------------------------------------------------
def test_running_covariance_equals_the_covariance_of_all_rows():
    x = torch.randn(2, 11, 5, generator=torch.Generator().manual_seed(0), dtype=DOUBLE)  # leading dims = rows
    rows = x.reshape(-1, 5)
    cov, count = None, 0
    for chunk in (x[:, :3], x[:, 3:4], x[:, 4:]):
        cov, count = uncentered_covariance_update(cov, count, chunk)
    assert count == 22
    torch.testing.assert_close(cov, rows.T @ rows / 22)
    # batch sums merged into an existing mean (what the distributed pass does)
    gram, n = second_moment(rows[10:])
    merged, total = merge_second_moment(rows[:10].T @ rows[:10] / 10, 10, gram, n)
    assert total == 22
    torch.testing.assert_close(merged, cov)
    empty, zero = merge_second_moment(None, 0, torch.zeros(5, 5), 0)
    assert zero == 0 and not empty.any()


# ----- projectors -------------------------------------------------------------------------------------------------
def test_projector_is_a_symmetric_idempotent_range_projector():
    x = _low_rank(20, 8, 3, seed=1)
    cov, _ = uncentered_covariance_update(None, 0, x)
    p, rank = null_space_projector(cov, 1e-8)
    assert rank == 3
    torch.testing.assert_close(p, p.T)
    torch.testing.assert_close(p @ p, p)
    torch.testing.assert_close(x @ p, x)  # the old features lie in its range (Thm. 8)


def test_threshold_edges_and_modes():
    """Spec §2.3/A3/A4: λ > λ_min keeps a direction. Threshold 0 on a full-rank covariance: P = I, so the dual
    update G − P_out G P_in is 0 (no plasticity left); a threshold above λ_max: P = 0, so ΔW = G."""
    full = torch.randn(50, 6, generator=torch.Generator().manual_seed(2), dtype=DOUBLE)
    cov = full.T @ full / 50
    identity, rank = null_space_projector(cov, 0.0)
    assert rank == 6
    torch.testing.assert_close(identity, torch.eye(6, dtype=DOUBLE))
    grad = torch.randn(4, 6, dtype=DOUBLE)
    out_identity = torch.eye(4, dtype=DOUBLE)
    assert dual_null_space_projection(grad, out_identity, identity).abs().max() < 1e-12
    zero, rank = null_space_projector(cov, float(torch.linalg.eigvalsh(cov).max()) + 1.0)
    assert rank == 0 and not zero.any()
    torch.testing.assert_close(dual_null_space_projection(grad, out_identity, zero), grad)

    eigenvalues = torch.tensor([0.1, 1.0, 2.0, 4.0], dtype=DOUBLE)
    assert kept_eigenvalues(eigenvalues, 0.5).tolist() == [False, True, True, True]  # absolute (paper)
    assert kept_eigenvalues(eigenvalues, 0.3, "relative").tolist() == [False, False, True, True]  # λ/λ_max
    assert not kept_eigenvalues(torch.zeros(3), 0.0, "relative").any()
    with pytest.raises(ValueError, match="threshold mode"):
        kept_eigenvalues(eigenvalues, 0.1, "energy")


def test_dual_projection_kills_old_alignment_and_is_an_orthogonal_projection():
    """Eq. (8) for a non-square weight [d_out=5, d_in=7]: z'ᵀ ΔW x = 0 for old partner outputs z' and old inputs x;
    ⟨G, ΔW⟩ = ‖ΔW‖² and proj(proj(G)) = proj(G) (Thm. 6)."""
    inputs, outputs = _low_rank(12, 7, 3, seed=3), _low_rank(12, 5, 2, seed=4)
    p_in, _ = null_space_projector(inputs.T @ inputs / 12, 1e-8)
    p_out, _ = null_space_projector(outputs.T @ outputs / 12, 1e-8)
    grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(5), dtype=DOUBLE)
    delta = dual_null_space_projection(grad, p_out, p_in)
    assert delta.shape == grad.shape
    torch.testing.assert_close(delta, grad - p_out @ grad @ p_in)
    assert (outputs @ delta @ inputs.T).abs().max() < 1e-10
    assert (outputs @ grad @ inputs.T).abs().max() > 1e-2
    torch.testing.assert_close((grad * delta).sum(), delta.pow(2).sum())
    torch.testing.assert_close(dual_null_space_projection(delta, p_out, p_in), delta)
    one_sided = dual_null_space_projection(grad, None, p_in)  # P_out = I: G (I − P_in)
    assert (one_sided @ inputs.T).abs().max() < 1e-10


def _alignment_drift(step: float, project: bool) -> float:
    """‖A_after − A_before‖ on old pairs after one SGD step of two learners on a new task (A = Z1 Z2ᵀ, rows)."""
    generator = torch.Generator().manual_seed(6)
    d_in1, d_in2, d_out, old = 8, 6, 5, 4
    w1 = torch.randn(d_out, d_in1, generator=generator, dtype=DOUBLE)
    w2 = torch.randn(d_out, d_in2, generator=generator, dtype=DOUBLE)
    x1, x2 = _low_rank(old, d_in1, 3, seed=7), _low_rank(old, d_in2, 3, seed=8)  # old pairs
    new1 = torch.randn(10, d_in1, generator=generator, dtype=DOUBLE)
    new2 = torch.randn(10, d_in2, generator=generator, dtype=DOUBLE)
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    logits = (new1 @ a.T) @ (new2 @ b.T).T
    nn.functional.cross_entropy(logits, torch.arange(10)).backward()
    g1, g2 = a.grad, b.grad
    if project:  # own inputs on the right, the partner's outputs on the left (Thm. 4)
        p_in1, _ = null_space_projector(x1.T @ x1, 1e-9)
        p_in2, _ = null_space_projector(x2.T @ x2, 1e-9)
        y1, y2 = x1 @ w1.T, x2 @ w2.T
        p_out1, _ = null_space_projector(y2.T @ y2, 1e-9)
        p_out2, _ = null_space_projector(y1.T @ y1, 1e-9)
        g1, g2 = dual_null_space_projection(g1, p_out1, p_in1), dual_null_space_projection(g2, p_out2, p_in2)
    before = (x1 @ w1.T) @ (x2 @ w2.T).T
    after = (x1 @ (w1 - step * g1).T) @ (x2 @ (w2 - step * g2).T).T
    return float((after - before).norm())


def test_one_projected_sgd_step_moves_old_alignments_at_second_order_only():
    """Thm. 4/5: with the projection the old alignment drifts as η² (halving η quarters it), without it as η."""
    step = 1e-2
    projected, plain = _alignment_drift(step, True), _alignment_drift(step, False)
    assert projected < 1e-3 * plain
    assert _alignment_drift(step / 2, True) / projected == pytest.approx(0.25, rel=1e-6)
    assert _alignment_drift(step / 2, False) / plain == pytest.approx(0.5, rel=0.05)


# ----- the method's hooks -----------------------------------------------------------------------------------------
class _Pair(nn.Module):
    """Two bias-free linear layers named like CLIP's projections."""

    def __init__(self, d_image: int = 7, d_text: int = 6, d_out: int = 5):
        super().__init__()
        torch.manual_seed(9)
        self.visual_projection = nn.Linear(d_image, d_out, bias=False)
        self.text_projection = nn.Linear(d_text, d_out, bias=False)


def _seeded_dns(model: _Pair, **options) -> tuple[DNS, dict[str, torch.Tensor]]:
    """A DNS whose state holds covariances of low-rank old features; returns it and those features."""
    images, texts = _low_rank(6, 7, 2, seed=10).float(), _low_rank(6, 6, 2, seed=11).float()
    with torch.no_grad():
        image_out, text_out = images @ model.visual_projection.weight.T, texts @ model.text_projection.weight.T
    method = DNS({"threshold_in": 1e-6, "threshold_out": 1e-6, **options})
    cov = {name: uncentered_covariance_update(None, 0, value)[0]
           for name, value in {"i": images, "t": texts, "io": image_out, "to": text_out}.items()}
    method.load_state_dict({
        "covariances": {"visual_projection": {"in": cov["i"], "out": cov["to"]},
                        "text_projection": {"in": cov["t"], "out": cov["io"]}},
        "counts": {"visual_projection": {"in": 6, "out": 6}, "text_projection": {"in": 6, "out": 6}},
        "tasks_seen": 1,
    })
    method.on_task_start(TaskContext(1, None, None, model, Path(".")))
    return method, {"images": images, "texts": texts, "image_out": image_out, "text_out": text_out}


def _adamw_step(model: _Pair, method: DNS) -> dict[str, torch.Tensor]:
    """One AdamW step (with weight decay) on a new-task loss through the method's hooks; returns the updates."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(12)
    images, texts = torch.randn(8, 7, generator=generator), torch.randn(8, 6, generator=generator)
    logits = model.visual_projection(images) @ model.text_projection(texts).T
    nn.functional.cross_entropy(logits, torch.arange(8)).backward()
    method.pre_optimizer_step(model, None)
    optimizer.step()
    method.post_optimizer_step(model, None)
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def _old_alignment_change(updates: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """First-order change of the old alignment, max over both learners: z_textᵀ ΔW_v x_image and the mirror."""
    visual = old["text_out"] @ updates["visual_projection.weight"] @ old["images"].T
    text = old["image_out"] @ updates["text_projection.weight"] @ old["texts"].T
    return float(max(visual.abs().max(), text.abs().max()))


def test_method_projects_gradients_and_with_update_mode_the_adamw_step():
    model = _Pair()
    method, old = _seeded_dns(model)
    assert method.ranks == {"visual_projection": {"in": 2, "out": 2}, "text_projection": {"in": 2, "out": 2}}
    gradient_mode = _old_alignment_change(_adamw_step(model, method), old)
    assert method.metrics()["active"] == 1.0 and method.metrics()["removed/visual_projection"] > 0

    model = _Pair()
    method, old = _seeded_dns(model, project="update")
    update_mode = _old_alignment_change(_adamw_step(model, method), old)
    assert update_mode < 1e-5  # exact at first order whatever AdamW does (spec A7)
    assert gradient_mode > 100 * update_mode  # AdamW's rescaling and weight decay break the gradient projection
    assert method.metrics()["update_removed/visual_projection"] > 0

    model = _Pair()
    method, old = _seeded_dns(model, variant="one_sided")
    assert method.ranks["visual_projection"] == {"in": 2, "out": -1}
    grad = torch.randn(5, 7)
    model.visual_projection.weight.grad = grad.clone()
    method.pre_optimizer_step(model, None)
    assert (model.visual_projection.weight.grad @ old["images"].T).abs().max() < 1e-5  # G (I − P_in)


def test_unseen_layers_and_bad_options():
    model = _Pair()
    method = DNS()
    method.on_task_start(TaskContext(0, None, None, model, Path(".")))
    assert method.metrics() == {"active": 0.0}
    model.visual_projection.weight.grad = grad = torch.randn(5, 7)
    method.pre_optimizer_step(model, None)
    assert torch.equal(model.visual_projection.weight.grad, grad)
    with pytest.raises(ValueError, match="variant"):
        DNS({"variant": "both"})
    with pytest.raises(ValueError, match="project"):
        DNS({"project": "weights"})
    with pytest.raises(ValueError, match="match no nn.Linear"):
        DNS({"layers": ["nope"]}).on_task_start(TaskContext(0, None, None, model, Path(".")))


# ----- a tiny CLIP run --------------------------------------------------------------------------------------------
def test_two_task_tiny_clip_run_projects_the_second_task_and_state_round_trips(tmp_path, clip_tokenizer):
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor
    from hf_ccl.testing import TrainingLogRecorder, tiny_clip

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=16)
    stream.tasks = stream.tasks[:2]
    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={"max_steps": 3, "per_device_train_batch_size": 8, "logging_steps": 1, "learning_rate": 1e-3},
        progress=False,
        evaluation={"initial": False},
    )
    options = {"dns": {"threshold_mode": "relative", "threshold_in": 1e-3, "threshold_out": 1e-3}}
    methods = build_methods(["dns"], options)
    recorder = TrainingLogRecorder()
    learner = ContinualLearner(tiny_clip(seed=0), stream, methods, load_image_processor(32), clip_tokenizer, args,
                               task_callbacks=[recorder])
    learner.fit()
    method = methods[0]
    active = [[log["dns/active"] for log in logs if "dns/active" in log] for logs in recorder.logs]
    assert active[0] and all(value == 0.0 for value in active[0])
    assert active[1] and all(value == 1.0 for value in active[1])
    removed = [log["dns/removed/visual_projection"] for log in recorder.logs[1] if "dns/removed/visual_projection" in log]
    assert removed and max(removed) > 0
    assert method.tasks_seen == 2
    assert method.counts["visual_projection"] == {"in": 64, "out": 64}
    ranks = method.ranks["visual_projection"]
    assert 0 < ranks["out"] < 32 and 0 < ranks["in"] <= 32  # few distinct class prompts: low-rank text side

    again = build_methods(["dns"], options)
    load_method_states(again, tmp_path / "task-1")  # written by the learner
    save_method_states(again, tmp_path)
    restored = build_methods(["dns"], options)
    load_method_states(restored, tmp_path)
    copy = restored[0]
    assert copy.counts == method.counts and copy.tasks_seen == 2
    for layer, sides in method.covariances.items():
        for side, value in sides.items():
            assert torch.equal(copy.covariances[layer][side], value)
    copy.build_projectors()
    method.build_projectors()
    assert copy.ranks == method.ranks
