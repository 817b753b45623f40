"""GEM and A-GEM on a full CLIP (hf_ccl.methods.gem, hf_ccl.methods.gem_projection): the projections by hand, the
constraints at every step of a tiny digits run, parameter selection, options, the memory and its state, and two
processes (gloo) ending with identical parameters.

The runs train on `conflicting_stream` (tests/scripts/gem_two_process.py): digits {0, 1}, then the same images with
swapped captions, so that the second task's gradients oppose the first task's memory at most steps (the next digits
task, {2, 3}, agrees with {0, 1} on a tiny CLIP after its first step: the projections would barely engage)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from scripts.gem_two_process import conflicting_stream
from test_distributed import launch_two_processes

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import load_image_processor, load_tokenizer
from hf_ccl.data.collate import CLIPCollator
from hf_ccl.methods import TaskContext, build_methods, load_method_states, save_method_states
from hf_ccl.methods import gem_projection as projection
from hf_ccl.methods.gem import AGEM, GEM, TaskMemory
from hf_ccl.methods.gem_projection import (
    agem_project,
    box_qp_residual,
    dots,
    flat_grad,
    gem_project,
    solve_box_qp,
    write_flat_grad,
)
from hf_ccl.methods.regularization import batch_contrastive_loss
from hf_ccl.testing import tiny_clip
from hf_ccl.validation import ConfigError

SCRIPT = Path(__file__).parent / "scripts" / "gem_two_process.py"
#: Relative error allowed for float32 inner products of ~1.7 M-entry gradients (summed in float32 blocks of 2^20).
FLOAT32 = 1e-5
#: Plain SGD: Adam's first steps (sign-like, lr-sized) make both tasks' gradients agree again after one step.
TRAINING = {"per_device_train_batch_size": 16, "max_steps": 8, "optim": "sgd", "learning_rate": 0.05,
            "weight_decay": 0.0, "lr_scheduler_type": "constant", "logging_steps": 1}


# ----- the projections by hand ------------------------------------------------------------------------------------
def test_gem_projection_two_constraints_by_hand():
    G = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # GGᵀ = [[1, 1], [1, 2]]
    g = torch.tensor([-1.0, -2.0, 1.0])  # ⟨g, g₁⟩ = −1, ⟨g, g₂⟩ = −3: both violated
    # Margin 0: the unconstrained dual optimum (−1, 2) is infeasible; v₁ = 0 on its bound, v₂ = 3/2
    # (∂/∂v₁ = v₂ − 1 = 1/2 ≥ 0), g̃ = g + 3/2 g₂ = (1/2, −1/2, 1): ⟨g̃, g₁⟩ = 1/2, ⟨g̃, g₂⟩ = 0.
    projected, v = gem_project(g, G, margin=0.0, eps=1e-12)
    torch.testing.assert_close(v, torch.tensor([0.0, 1.5], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([0.5, -0.5, 1.0]))
    torch.testing.assert_close(G @ projected, torch.tensor([0.5, 0.0]))
    # Margin 1/2: v₁ = 1/2 on its bound, v₂ = (3 − 1/2)/2 = 5/4 (∂/∂v₁ = v₁ + v₂ − 1 = 3/4 ≥ 0),
    # g̃ = g + 1/2 g₁ + 5/4 g₂ = (3/4, −3/4, 1).
    projected, v = gem_project(g, G, margin=0.5, eps=1e-12)
    torch.testing.assert_close(v, torch.tensor([0.5, 1.25], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([0.75, -0.75, 1.0]))
    assert projected.dtype == torch.float32
    # The blockwise float64 algebra does not depend on the block size.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(projection, "CHUNK", 2)
        blocked, blocked_v = gem_project(g, G, margin=0.5, eps=1e-12)
        torch.testing.assert_close(dots(G, g), torch.tensor([-1.0, -3.0], dtype=torch.float64))
    torch.testing.assert_close(blocked, projected)
    torch.testing.assert_close(blocked_v, v)


def test_agem_projection_by_hand():
    g, g_ref = torch.tensor([1.0, -2.0, 0.0]), torch.tensor([0.0, 1.0, 1.0])
    projected, changed = agem_project(g, g_ref)  # gᵀg_ref = −2, ‖g_ref‖² = 2: g̃ = g + g_ref
    assert changed
    torch.testing.assert_close(projected, torch.tensor([1.0, -1.0, 1.0]))
    assert float(projected @ g_ref) == 0.0
    same, changed = agem_project(-g, g_ref)
    assert not changed and same is not None and torch.equal(same, -g)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(projection, "CHUNK", 2)
        torch.testing.assert_close(agem_project(g, g_ref)[0], projected)
    g = torch.tensor([1.0, -2.0, 0.5])  # gᵀg_ref = −1.5: g̃ = g + (1.5 / 2) g_ref, orthogonal to g_ref
    projected, changed = agem_project(g, g_ref)
    assert changed
    torch.testing.assert_close(projected, g - (-1.5 / 2.0) * g_ref)
    assert abs(float(projected @ g_ref)) < 1e-6


# ----- GEM's QP (moved from the pairs package's tests) --------------------------------------------------------------
def test_gem_projection_hand_computed_two_tasks():
    G = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)  # GGᵀ = [[1, 1], [1, 2]]
    # Interior: v = −(GGᵀ)⁻¹ G g = (1, 1) ≥ 0.5, and g̃ = g + g₁ + g₂ is orthogonal to both.
    g = torch.tensor([-2.0, -1.0, 1.0], dtype=torch.float64)
    projected, v = gem_project(g, G, margin=0.5, eps=1e-12)
    torch.testing.assert_close(v, torch.tensor([1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    # One multiplier on its bound: v₂ = 0.5, v₁ = 2 − 0.5 = 1.5 (and ∂/∂v₂ = 1.5 + 1 − 1 ≥ 0).
    g = torch.tensor([-2.0, 1.0, 1.0], dtype=torch.float64)
    projected, v = gem_project(g, G, margin=0.5, eps=1e-12)
    torch.testing.assert_close(v, torch.tensor([1.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([0.0, 1.5, 1.0], dtype=torch.float64))
    # A large margin binds both: v = (1.5, 1.5).
    g = torch.tensor([-2.0, -1.0, 1.0], dtype=torch.float64)
    projected, v = gem_project(g, G, margin=1.5, eps=1e-12)
    torch.testing.assert_close(v, torch.tensor([1.5, 1.5], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64))
    # The official ε = 1e-3 on an orthonormal G: v = max(margin, −Gg / (1 + ε)), so ⟨g̃, g₁⟩ = −ε v₁ (not 0).
    G = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    g = torch.tensor([1.0, -1.0], dtype=torch.float64)
    projected, v = gem_project(g, G, margin=0.5, eps=1e-3)
    torch.testing.assert_close(v, torch.tensor([1 / 1.001, 0.5], dtype=torch.float64))
    torch.testing.assert_close(projected, torch.tensor([1.5, -1 + 1 / 1.001], dtype=torch.float64))


def _random_qp(seed: int, t: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    G = torch.randn(t, p, generator=generator, dtype=torch.float64)
    if t > 2:
        G[-1] = G[0] + G[1]  # linearly dependent rows: GGᵀ is singular without ε
    g = torch.randn(p, generator=generator, dtype=torch.float64) - G.sum(0) / t  # violates some constraints
    return G, g


@pytest.mark.parametrize("margin", [0.0, 0.5])
@pytest.mark.parametrize(
    ("seed", "t", "p"), [(0, 1, 5), (1, 2, 6), (2, 4, 30), (3, 9, 30), (4, 15, 40), (5, 12, 5)]
)
def test_box_qp_matches_brute_force(seed: int, t: int, p: int, margin: float):
    G, g = _random_qp(seed, t, p)
    eps = 1e-3
    Q = G @ G.T + eps * torch.eye(t, dtype=torch.float64)
    c = G @ g
    v = solve_box_qp(Q, c, margin, tol=1e-12)
    scale = max(float(Q.abs().max()), float(c.abs().max()))
    assert box_qp_residual(Q, c, margin, v) <= 1e-9 * scale  # KKT: v ≥ γ, r ≥ 0, (v − γ)·r = 0
    assert bool((v >= margin).all())

    def objective(x: torch.Tensor) -> float:
        return float(0.5 * x @ Q @ x + c @ x)

    # No feasible point does better: random feasible points and every coordinate nudge.
    generator = torch.Generator().manual_seed(100 + seed)
    others = margin + torch.rand(2000, t, generator=generator, dtype=torch.float64) * (2 * float(v.max()) + 1)
    values = 0.5 * torch.einsum("ni,ij,nj->n", others, Q, others) + others @ c
    assert objective(v) <= float(values.min()) + 1e-12 * scale
    for i, step in itertools.product(range(t), (1e-4, -1e-4)):
        nudged = v.clone()
        nudged[i] = max(margin, float(nudged[i]) + step)
        assert objective(v) <= objective(nudged) + 1e-12 * scale
    optimize = pytest.importorskip("scipy.optimize")
    reference = optimize.minimize(
        lambda x: objective(torch.from_numpy(x)),
        x0=torch.full((t,), margin + 1.0, dtype=torch.float64).numpy(),
        jac=lambda x: (Q @ torch.from_numpy(x) + c).numpy(),
        bounds=[(margin, None)] * t,
        method="L-BFGS-B",
        options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 10_000},
    )
    assert objective(v) <= reference.fun + 1e-9 * scale
    torch.testing.assert_close(
        v, torch.from_numpy(reference.x), atol=1e-4 * max(1.0, float(v.abs().max())), rtol=0
    )


@pytest.mark.parametrize("margin", [0.0, 0.5])
def test_box_qp_two_tasks_against_a_grid(margin: float):
    G, g = _random_qp(7, 2, 6)
    Q, c = G @ G.T + 1e-3 * torch.eye(2, dtype=torch.float64), G @ g
    v = solve_box_qp(Q, c, margin)
    axis = torch.linspace(margin, margin + 3 * float(v.max()) + 1, 1201, dtype=torch.float64)
    grid = torch.cartesian_prod(axis, axis)
    values = 0.5 * torch.einsum("ni,ij,nj->n", grid, Q, grid) + grid @ c
    best = grid[values.argmin()]
    assert float(0.5 * v @ Q @ v + c @ v) <= float(values.min()) + 1e-12
    torch.testing.assert_close(v, best, atol=float(axis[1] - axis[0]), rtol=0)


@pytest.mark.parametrize(("seed", "t"), [(0, 2), (1, 5), (2, 12)])
def test_gem_projection_satisfies_constraints(seed: int, t: int):
    G, g = _random_qp(seed, t, 30)
    assert bool((G @ g < 0).any())
    # With ε → 0 the projection is exact: ⟨g̃, g_k⟩ ≥ 0 for every k.
    projected, v = gem_project(g, G, margin=0.0, eps=1e-12, tol=1e-13)
    assert bool((G @ projected >= -1e-8).all())
    projected, v = gem_project(g, G, margin=0.5, eps=1e-12, tol=1e-13)
    assert bool((G @ projected >= -1e-8).all())
    # With the official ε, ⟨g̃, g_k⟩ = r_k − ε v_k ≥ −ε v_k.
    projected, v = gem_project(g, G, margin=0.5, eps=1e-3)
    assert bool((G @ projected >= -1e-3 * v - 1e-9).all())


def test_flat_gradients_round_trip_and_keep_missing_grads_missing():
    a, b, c = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((2, 2), (3,), (2,)))
    a.grad, b.grad = torch.arange(4.0).view(2, 2), torch.ones(3)
    flat = flat_grad([a, b, c])
    torch.testing.assert_close(flat, torch.tensor([0.0, 1, 2, 3, 1, 1, 1, 0, 0]))
    write_flat_grad([a, b, c], flat * 2)
    torch.testing.assert_close(a.grad, torch.arange(4.0).view(2, 2) * 2)
    assert c.grad is None  # zero where there was no grad: still none (an optimizer would decay a zero grad)
    write_flat_grad([a, b, c], torch.ones(9))
    torch.testing.assert_close(c.grad, torch.ones(2))
    with pytest.raises(ValueError, match="8 entries"):
        write_flat_grad([a, b, c], torch.ones(8))


def test_in_place_projections_equal_the_flat_computation_bitwise():
    """A-GEM's projection added to `p.grad` in place, GEM's g + Gᵀv into g's own buffer and flat gradients written
    into a reused buffer give exactly the values of the flat computation they replace."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((300, 7), (11,), (4, 5))]
    grads = [torch.randn(p.shape, generator=generator) for p in params]
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad.clone()
    g = flat_grad(params)
    buffer = torch.full_like(g, float("nan"))
    assert flat_grad(params, out=buffer) is buffer and torch.equal(buffer, g)
    ref = torch.randn(g.shape, generator=generator)
    expected, changed = agem_project(g, ref, (-3.0, 7.0))
    assert changed and projection.add_to_grads_(params, ref, projection.agem_coefficient(-3.0, 7.0))
    assert torch.equal(flat_grad(params), expected)
    G, v = torch.randn(3, g.numel(), generator=generator), torch.rand(3, dtype=torch.float64, generator=generator)
    combined = projection.combine(g, G, v)
    assert torch.equal(projection.combine(g.clone(), G, v, out=buffer), combined)
    g_in_place = g.clone()
    assert torch.equal(projection.combine(g_in_place, G, v, out=g_in_place), combined)
    params[1].grad = None  # a missing (or sparse) grad: refused, nothing touched, the caller writes the flat vector
    before = flat_grad(params)
    assert not projection.add_to_grads_(params, ref, -0.5) and torch.equal(flat_grad(params), before)
    assert projection.agem_coefficient(1.0, 2.0) is None and projection.agem_coefficient(-1.0, 0.0) is None


# ----- runs on the tiny digits stream -----------------------------------------------------------------------------
def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


class RecordingGEM(GEM):
    """GEM that records, at every step, every gradient before and after its hook and the memory gradients G."""

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.steps: list[dict[str, Any]] = []
        self._G: torch.Tensor | None = None

    def memory_gradients(self, model, context, params):  # noqa: ANN001, ANN201
        memories, G = super().memory_gradients(model, context, params)
        self._G = G.clone()
        return memories, G

    def pre_optimizer_step(self, model, context) -> None:  # noqa: ANN001
        before, self._G = _grads(model), None
        super().pre_optimizer_step(model, context)
        self.steps.append({"task": context.task_index, "before": before, "after": _grads(model), "G": self._G,
                           "metrics": self.metrics()})


class RecordingAGEM(AGEM):
    """A-GEM that records every gradient before and after its hook and g_ref."""

    def __init__(self, config: Any = None):
        super().__init__(config)
        self.steps: list[dict[str, Any]] = []
        self._ref: torch.Tensor | None = None

    def reference_gradient(self, model, context, params):  # noqa: ANN001, ANN201
        ref = super().reference_gradient(model, context, params)
        self._ref = ref.clone()  # the method's scratch buffer, overwritten at the next step
        return ref

    def pre_optimizer_step(self, model, context) -> None:  # noqa: ANN001
        before, self._ref = _grads(model), None
        super().pre_optimizer_step(model, context)
        self.steps.append({"task": context.task_index, "before": before, "after": _grads(model), "ref": self._ref,
                           "metrics": self.metrics()})


def fit(methods: list, output_dir: Path, training: dict[str, Any] | None = None, seed: int = 1) -> ContinualLearner:
    args = ContinualArguments(output_dir=str(output_dir), training=dict(training or TRAINING), progress=False,
                              seed=seed, evaluation={"initial": False}, save_checkpoints=False)
    learner = ContinualLearner(tiny_clip(seed=seed), conflicting_stream(), methods, load_image_processor(32),
                               load_tokenizer(), args)
    learner.fit()
    return learner


def _flat(grads: dict[str, torch.Tensor | None], names: list[str], model: torch.nn.Module) -> torch.Tensor:
    params = dict(model.named_parameters())
    return torch.cat([(grads[n] if grads[n] is not None else torch.zeros_like(params[n])).reshape(-1) for n in names])


def _unchanged(step: dict[str, Any], names: list[str] | None = None) -> bool:
    names = list(step["before"]) if names is None else names
    for name in names:
        before, after = step["before"][name], step["after"][name]
        if (before is None) != (after is None) or (before is not None and not torch.equal(before, after)):
            return False
    return True


@pytest.fixture(scope="module")
def gem_run(tmp_path_factory):
    method = RecordingGEM({"memory_per_task": 16})
    learner = fit([method], tmp_path_factory.mktemp("gem"))
    return learner, method


def test_gem_steps_satisfy_the_constraints_and_leave_compatible_gradients_alone(gem_run):
    learner, method = gem_run
    names, _ = method.selected_parameters(learner.model)
    assert len(names) == sum(1 for p in learner.model.parameters() if p.requires_grad)  # default: every one
    first = [s for s in method.steps if s["task"] == 0]
    second = [s for s in method.steps if s["task"] == 1]
    assert len(first) == len(second) == TRAINING["max_steps"]
    assert all(s["G"] is None and _unchanged(s) for s in first)  # no memory yet
    violated_steps = 0
    for step in second:
        G = step["G"]
        assert G is not None and G.shape == (1, len(_flat(step["before"], names, learner.model)))
        g, projected = _flat(step["before"], names, learner.model), _flat(step["after"], names, learner.model)
        violated = bool((dots(G, g) < 0).any())
        violated_steps += violated
        assert step["metrics"]["violations"] == float(violated) and step["metrics"]["constraints"] == 1.0
        if not violated:
            assert _unchanged(step)  # every parameter's gradient, bit for bit
            continue
        assert not torch.equal(g, projected) and step["metrics"]["projected"] == 1.0
        change = float((projected.double() - g.double()).norm() / g.double().norm())
        assert step["metrics"]["grad_change"] == pytest.approx(change, rel=1e-4)
        expected, v = gem_project(g, G, method.config.memory_strength, method.config.qp_eps)
        torch.testing.assert_close(projected, expected, rtol=0, atol=0)
        # ⟨g̃, g_k⟩ ≥ −ε v_k (the QP's ridge), less float32 error: inner products summed in float32 blocks, g̃
        # rounded to float32 (relative to ‖g‖ ‖g_k‖ and ‖g̃‖ ‖g_k‖: g̃ may be much shorter than g).
        rounding = FLOAT32 * (float(g.double().norm()) + float(projected.double().norm())) * G.double().norm(dim=1)
        assert bool((dots(G, projected) >= -method.config.qp_eps * v.to(G.device) - rounding).all())
    assert violated_steps >= len(second) // 2, f"only {violated_steps} steps conflicted: the check is weak"
    # Compute: task 1's steps also encode and back-propagate 16 memory rows each (measured in its MACs).
    first, second = (c.macs / c.optimizer_steps for c in learner.compute)
    assert second > 1.5 * first


def _set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    for param in params:
        param.grad = None
    write_flat_grad(params, flat)


def _memory_context(learner: ContinualLearner, task_index: int) -> TaskContext:
    stream = conflicting_stream()
    collator = CLIPCollator(load_image_processor(32), load_tokenizer(), train=False)
    return TaskContext(task_index=task_index, task=stream[min(task_index, 1)], stream=stream, model=learner.model,
                       collator=collator)


def test_a_compatible_gradient_is_left_untouched_and_an_opposed_one_projected(gem_run):
    """Either path of one step, on the trained model: g = g₀/‖g₀‖ + g₁/‖g₁‖ agrees with both memories (left alone, bit for
    bit), g = −g₀ opposes the first (projected onto ⟨g̃, g_k⟩ ≥ −ε v_k); A-GEM: g = g_ref alone, g = −g_ref → 0."""
    learner, trained = gem_run
    model = learner.model
    context = _memory_context(learner, 2)
    method = GEM({"memory_per_task": 16})
    method.memories = list(trained.memories)
    _, params = method.selected_parameters(model)
    _, G = method.memory_gradients(model, context, params)
    agreeing = (G / G.norm(dim=1, keepdim=True)).sum(0)  # ⟨·, g_k⟩ = ‖g_k‖ (1 + cos(g₀, g₁)) > 0
    assert bool((dots(G, agreeing) > 0).all())
    _set_grads(params, agreeing)
    before = _grads(model)
    method.pre_optimizer_step(model, context)
    assert _unchanged({"before": before, "after": _grads(model)}) and method.metrics()["violations"] == 0.0
    _set_grads(params, -G[0])
    method.pre_optimizer_step(model, context)
    projected = flat_grad(params)
    assert method.metrics()["projected"] == 1.0 and method.metrics()["violations"] >= 1.0
    margin = method.config.qp_eps * method.metrics()["dual_max"]
    rounding = FLOAT32 * float(G[0].double().norm() + projected.double().norm()) * G.double().norm(dim=1)
    assert bool((dots(G, projected) >= -margin - rounding).all())

    agem = AGEM({"memory_per_task": 16, "reference_batch_size": 8})
    agem.memories = list(trained.memories)
    g_ref = agem.reference_gradient(model, context, params)
    _set_grads(params, g_ref)
    before = _grads(model)
    agem.pre_optimizer_step(model, context)
    assert _unchanged({"before": before, "after": _grads(model)}) and agem.metrics()["projected"] == 0.0
    assert agem.metrics()["ref_cosine"] == pytest.approx(1.0)
    _set_grads(params, -g_ref)
    agem.pre_optimizer_step(model, context)
    assert agem.metrics()["projected"] == 1.0
    assert float(flat_grad(params).abs().max()) <= 1e-6 * float(g_ref.abs().max())
    for param in params:
        param.grad = None


def test_gem_memory_state_round_trip_and_memory_gradient(gem_run, tmp_path):
    learner, method = gem_run
    stream = conflicting_stream()
    assert [m.task_index for m in method.memories] == [0, 1]
    for memory in method.memories:
        assert len(memory) == 16 == len(set(memory.rows)) and max(memory.rows) < len(stream[memory.task_index].train)
    save_method_states([method], tmp_path)
    restored = GEM({"memory_per_task": 16})
    load_method_states([restored], tmp_path)
    assert restored.memories == method.memories
    # The same seeds draw the same memory again.
    again = GEM({"memory_per_task": 16})
    for index in (0, 1):
        again.on_task_end(TaskContext(task_index=index, task=stream[index], stream=stream, model=learner.model,
                                      seed=1 + index))
    assert again.memories == method.memories
    # The memory loss is the model's own contrastive loss on one process, and a restored method computes the same G.
    collator = CLIPCollator(load_image_processor(32), load_tokenizer(), train=False)
    context = TaskContext(task_index=2, task=stream[1], stream=stream, model=learner.model, collator=collator)
    model = learner.model.eval()
    batch = restored.memory_batch(context, [(restored.memories[0], None)], torch.device("cpu"))
    torch.testing.assert_close(batch_contrastive_loss(model, batch), model(**batch, return_loss=True).loss)
    _, params = method.selected_parameters(model)
    before = _grads(model)
    _, G = method.memory_gradients(model, context, params)
    _, G_restored = restored.memory_gradients(model, context, params)
    assert G.shape[0] == 2 and torch.equal(G, G_restored)
    assert _unchanged({"before": before, "after": _grads(model)})  # torch.autograd.grad: p.grad untouched


def test_gem_memory_batches_equal_the_collators_and_chunks_average(gem_run):
    learner, method = gem_run
    stream = conflicting_stream()
    collator = CLIPCollator(load_image_processor(32), load_tokenizer(), train=False)
    context = TaskContext(task_index=2, task=stream[1], stream=stream, model=learner.model, collator=collator)
    agem = AGEM({"memory_per_task": 16, "reference_batch_size": 20})
    agem.memories = list(method.memories)
    parts, order = agem.reference_rows(context)
    assert sum(len(positions) for _, positions in parts) == 20 and len(parts) == 2
    batch = agem.memory_batch(context, parts, torch.device("cpu"), order)
    grouped = [stream[m.task_index].train[m.rows[int(p)]] for m, positions in parts for p in positions]
    expected = collator([grouped[int(i)] for i in order])
    assert set(batch) == {"pixel_values", "input_ids", "attention_mask", "text_hash", "image_hash"}
    for key, value in batch.items():
        assert torch.equal(value, expected[key]), key
    assert agem.reference_rows(context)[1].tolist() == order.tolist()  # seeded by the step: the same draw
    context.global_step = 1
    assert agem.reference_rows(context)[1].tolist() != order.tolist()
    # memory_batch_size: the size-weighted mean of the chunks' losses.
    model = learner.model
    _, params = method.selected_parameters(model)
    whole = AGEM()
    head = whole.loss_gradient(model, context, params, {k: v[:8] for k, v in batch.items()})
    tail = whole.loss_gradient(model, context, params, {k: v[8:16] for k, v in batch.items()})
    chunked = AGEM({"memory_batch_size": 8}).loss_gradient(model, context, params, {k: v[:16] for k, v in batch.items()})
    torch.testing.assert_close(chunked, (head + tail) / 2, rtol=1e-5, atol=1e-7)


def test_agem_steps_satisfy_the_constraint(tmp_path):
    method = RecordingAGEM({"memory_per_task": 16, "reference_batch_size": 8})
    learner = fit([method], tmp_path)
    names, _ = method.selected_parameters(learner.model)
    second = [s for s in method.steps if s["task"] == 1]
    assert all(s["ref"] is None and _unchanged(s) for s in method.steps if s["task"] == 0)
    violated_steps = 0
    for step in second:
        g, projected, ref = (_flat(step["before"], names, learner.model), _flat(step["after"], names, learner.model),
                             step["ref"])
        violated = float(g.double() @ ref.double()) < 0
        violated_steps += violated
        if not violated:
            assert _unchanged(step)
            continue
        scale = float((g.double().norm() + projected.double().norm()) * ref.double().norm())
        assert abs(float(projected.double() @ ref.double())) <= FLOAT32 * scale  # on the constraint's boundary
        torch.testing.assert_close(projected, agem_project(g, ref)[0], rtol=0, atol=0)
        change = float((projected.double() - g.double()).norm() / g.double().norm())
        assert step["metrics"]["grad_change"] == pytest.approx(change, rel=1e-4)
    assert violated_steps >= len(second) // 2, f"only {violated_steps} steps conflicted: the check is weak"
    first, second = (c.macs / c.optimizer_steps for c in learner.compute)  # 8 reference rows per 16 examples
    assert 1.2 * first < second < 1.8 * first


def test_parameters_option_constrains_only_the_chosen_parameters(tmp_path):
    method = RecordingGEM({"memory_per_task": 16, "parameters": ["text_projection.weight"]})
    learner = fit([method], tmp_path)
    assert method.selected_parameters(learner.model)[0] == ["text_projection.weight"]
    others = [name for name in method.steps[0]["before"] if name != "text_projection.weight"]
    steps = [s for s in method.steps if s["task"] == 1]
    assert all(_unchanged(step, others) for step in steps)
    assert all(s["G"].shape == (1, learner.model.text_projection.weight.numel()) for s in steps)
    assert any(not _unchanged(step, ["text_projection.weight"]) for step in steps)


# ----- options and refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "options", "key"),
    [
        ("gem", {"memory_per_task": 0}, "memory_per_task"),
        ("gem", {"qp_eps": 0.0}, "qp_eps"),
        ("gem", {"qp_tol": 0.0}, "qp_tol"),
        ("gem", {"memory_strength": -0.1}, "memory_strength"),
        ("gem", {"memory_batch_size": 0}, "memory_batch_size"),
        ("gem", {"parameters": []}, "parameters"),
        ("agem", {"reference_batch_size": 0}, "reference_batch_size"),
        ("agem", {"parameters": "text_projection.weight"}, "parameters"),
    ],
)
def test_bad_options_are_refused_naming_the_option(name: str, options: dict[str, Any], key: str):
    with pytest.raises(ConfigError) as error:
        build_methods([name], {name: options})
    assert error.value.key == f"method_args.{name}.{key}"
    assert "\n" not in str(error.value)


def test_gem_and_agem_do_not_combine():
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_methods(["gem", "agem"])


def test_parameter_patterns_are_checked_before_training():
    stream = conflicting_stream()
    model = tiny_clip(seed=0)
    context = TaskContext(task_index=0, task=stream[0], stream=stream, model=model)
    with pytest.raises(ConfigError, match=r"method_args\.gem\.parameters: pattern\(s\) \['nope\.\*'\]"):
        GEM({"parameters": ["text_projection.weight", "nope.*"]}).training_overrides(context, {})
    model.text_projection.weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="match no trainable parameter") as error:
        AGEM({"parameters": ["text_projection.*"]}).training_overrides(context, {})
    assert error.value.key == "method_args.agem.parameters"
    with pytest.raises(ConfigError, match="max_grad_norm"):
        GEM().training_overrides(context, {"fp16": True, "max_grad_norm": 0.0})
    assert AGEM().training_overrides(context, {"fp16": True, "max_grad_norm": 0.0}) == {}  # scale-invariant


def test_streaming_train_splits_are_refused_at_task_start():
    stream = conflicting_stream()
    stream.tasks[0].train = stream.tasks[0].train.to_iterable_dataset()
    context = TaskContext(task_index=0, task=stream[0], stream=stream, model=tiny_clip(seed=0))
    with pytest.raises(ValueError, match=r"stream \(IterableDataset\)"):
        GEM().on_task_start(context)
    last = conflicting_stream()
    last.tasks[1].train = last.tasks[1].train.to_iterable_dataset()  # the last task's memory is never used
    GEM().on_task_start(TaskContext(task_index=0, task=last[0], stream=last, model=tiny_clip(seed=0)))


def test_a_memory_from_another_stream_is_an_error():
    stream = conflicting_stream()
    method = GEM()
    method.memories = [TaskMemory(0, "other", [0, 10_000])]
    collator = CLIPCollator(load_image_processor(32), load_tokenizer(), train=False)
    context = TaskContext(task_index=1, task=stream[1], stream=stream, model=tiny_clip(seed=0), collator=collator)
    with pytest.raises(ValueError, match="another stream"):
        method.memory_batch(context, [(method.memories[0], None)], torch.device("cpu"))


# ----- two processes ----------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_two_processes_keep_identical_parameters(tmp_path):
    launch_two_processes(SCRIPT, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for name in ("gem", "agem"):
        first, second = (report[name] for report in reports)
        assert first["world_size"] == second["world_size"] == 2
        assert first["projected_steps"] > 0, f"{name} never projected: the check would be vacuous"
        assert first == second, f"{name}: ranks disagree"



@pytest.mark.parametrize("method", ["gem", "agem"])
def test_memories_of_earlier_tasks_train_under_the_class_prompt_cross_entropy(tmp_path, method):
    """`classification_loss: cross_entropy` through the CLI: the memories of task 0 are collated in task 1 with
    their own task's class prompts (they once failed: 'no class prompt of the task(s)')."""
    from hf_ccl.cli import main

    assert main(["train", "--config", "digits", f"methods=[{method}]", "classification_loss=cross_entropy",
                 "model.config.hidden_size=32", "model.config.num_layers=1", "stream_args.max_train_per_task=16",
                 "stream_args.max_eval_per_task=8", "training.num_train_epochs=1", "training.warmup_steps=0",
                 "training.per_device_train_batch_size=8", f"output_dir={tmp_path}", "progress=false",
                 "stream_args.label_space=task"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["rows"]) >= 5
