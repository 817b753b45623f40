"""EWC, SI, MAS and their shared quadratic penalty: hand-computed values, manual autograd, a real 2-task stream."""

from pathlib import Path

import pytest
import torch
from torch import nn

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.data.collate import CLIPCollator
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.ewc import EWC
from hf_ccl.methods.mas import MAS
from hf_ccl.methods.regularization import (
    QuadraticPenalty,
    accumulate_importance,
    batch_contrastive_loss,
    mean_gradient_statistic,
    plan_batches,
    select_parameters,
    squared_embedding_norms,
    token_embedding_name,
    weighted_squares,
)
from hf_ccl.methods.si import SI, PathIntegral
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.testing import TrainingLogRecorder, tiny_clip


class _Two(nn.Module):
    """Two parameters with hand-picked values."""

    def __init__(self, a: list[float], b: list[float]):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))


def _context(model: nn.Module, **fields) -> TaskContext:
    return TaskContext(task_index=0, task=None, stream=None, model=model, output_dir=Path("."), **fields)


def _batches(seed: int, sizes: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Random CLIP batches; texts 0 and 1 of each batch are duplicates (positives of each other)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for size in sizes:
        ids = torch.randint(0, 49405, (size, 6), generator=generator)
        ids[:, -1] = 49407
        ids[1] = ids[0]
        mask = torch.ones_like(ids)
        mask[-1, 4:] = 0
        text_hash = torch.arange(size)
        text_hash[1] = text_hash[0]
        batches.append(
            {
                "pixel_values": torch.randn(size, 3, 32, 32, generator=generator),
                "input_ids": ids,
                "attention_mask": mask,
                "text_hash": text_hash,
                "image_hash": torch.arange(size) + 100,
            }
        )
    return batches


# ----- the penalty ------------------------------------------------------------------------------------------------
def test_penalty_hand_computed():
    model = _Two([1.0, 3.0], [0.5])
    penalty = QuadraticPenalty()
    penalty.set(
        {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}, {"a": torch.zeros(2), "b": torch.zeros(1)}
    )
    penalty.anchor = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([2.0])}
    value = penalty.value(model)
    assert value.item() == pytest.approx(1 * 1**2 + 2 * 2**2 + 3 * 1.5**2)  # 15.75
    value.backward()
    assert torch.allclose(model.a.grad, torch.tensor([2.0, 8.0]))  # 2 Ω (θ − θ*)
    assert torch.allclose(model.b.grad, torch.tensor([-9.0]))

    ewc = EWC({"ewc_lambda": 4.0})
    ewc.penalty = penalty
    term = ewc.loss_terms(model, {}, None, None)["penalty"]
    assert term.item() == pytest.approx(2.0 * 15.75)  # (λ/2) Σ F Δθ²


def test_penalty_matches_naive_sum():
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]
    anchors = [torch.randn(s, generator=generator) for s in shapes]
    importances = [torch.rand(s, generator=generator) for s in shapes]
    fused = weighted_squares(params, anchors, importances)
    fused_grads = torch.autograd.grad(3.0 * fused, params)
    naive = sum((w * (p - a) ** 2).sum() for p, a, w in zip(params, anchors, importances, strict=True))
    naive_grads = torch.autograd.grad(3.0 * naive, params)
    assert torch.allclose(fused, naive)
    for mine, reference in zip(fused_grads, naive_grads, strict=True):
        assert torch.allclose(mine, reference)


def test_token_embedding_rows_penalty_matches_the_dense_one():
    model = tiny_clip(seed=4)
    params = select_parameters(model)
    generator = torch.Generator().manual_seed(0)
    importance = {name: torch.rand(p.shape, generator=generator) for name, p in params.items()}
    token = token_embedding_name(model)
    importance[token][10:] = 0.0  # a task touches few tokens
    results = []
    for sparse in (True, False):
        penalty = QuadraticPenalty(sparse_token_rows=sparse)
        penalty.set(importance, params)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        ids = torch.tensor([[49406, 5, 11, 49407]])
        value = penalty.value(model)
        loss = value + model.embed_texts(ids).sum()  # the model's own (dense) embedding gradient too
        grads = torch.autograd.grad(loss, list(params.values()))
        assert bool(penalty._aligned_cache.rows) == sparse
        results.append((value.detach(), grads))
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.01)
    (sparse_value, sparse_grads), (dense_value, dense_grads) = results
    assert torch.allclose(sparse_value, dense_value, rtol=1e-5)
    for name, mine, reference in zip(params, sparse_grads, dense_grads, strict=True):
        assert mine.layout == torch.strided
        assert torch.allclose(mine, reference, rtol=1e-5, atol=1e-8), name


def test_penalty_before_any_task_is_zero_and_grown_rows_are_free():
    model = _Two([1.0, 2.0], [0.0])
    ewc = EWC()
    assert ewc.loss_terms(model, {}, None, None)["penalty"].item() == 0.0
    penalty = QuadraticPenalty()
    penalty.set({"a": torch.ones(2)}, dict(model.named_parameters()))
    with torch.no_grad():
        model.a.add_(1.0)
    before = penalty.value(model).item()
    model.a = nn.Parameter(torch.cat([model.a.detach(), torch.tensor([50.0])]))  # a new (token) row
    assert penalty.value(model).item() == pytest.approx(before)
    model.a = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="only growth along dim 0"):
        penalty.value(model)


def test_parameter_selection_excludes_token_embedding_and_patterns():
    model = tiny_clip()
    token = token_embedding_name(model)
    assert token == "text_model.embeddings.token_embedding.weight"
    everything = select_parameters(model)
    assert token in everything and len(everything) == sum(p.requires_grad for p in model.parameters())
    assert token not in select_parameters(model, exclude_token_embedding=True)
    no_vision = select_parameters(model, exclude=["vision_model.*", "visual_projection.*"])
    assert no_vision and not any(
        name.startswith(("vision_model.", "visual_projection.")) for name in no_vision
    )


def test_accumulation_rules():
    old = {"a": torch.tensor([2.0]), "gone": torch.tensor([4.0])}
    new = {"a": torch.tensor([1.0]), "fresh": torch.tensor([3.0])}
    online = accumulate_importance(old, new, "sum", gamma=0.5)  # F <- γF + F_t
    assert online["a"].item() == 2.0 and online["gone"].item() == 2.0 and online["fresh"].item() == 3.0
    average = accumulate_importance(old, new, "average", tasks_before=1)  # α = 1/2
    assert average["a"].item() == 1.5 and average["gone"].item() == 2.0 and average["fresh"].item() == 1.5
    grown = accumulate_importance({"a": torch.ones(1, 2)}, {"a": torch.ones(3, 2)}, "sum")
    assert torch.equal(grown["a"], torch.tensor([[2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]))


def test_plan_batches_is_rank_independent_and_seeded():
    assert plan_batches(10, 4, None, seed=0) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # incomplete last batch dropped
    assert plan_batches(3, 4, None, seed=0) == [[0, 1, 2]]  # ... unless it is the only one
    assert plan_batches(10, 4, None, seed=0, drop_last=False)[-1] == [8, 9]
    subset = plan_batches(100, 4, 2, seed=1)
    assert (
        subset == plan_batches(100, 4, 2, seed=1)
        and len(subset) == 2
        and subset != [[0, 1, 2, 3], [4, 5, 6, 7]]
    )


# ----- EWC ----------------------------------------------------------------------------------------------------------
def test_ewc_fisher_is_the_mean_squared_batch_gradient():
    model = tiny_clip(seed=1)
    batches = _batches(0, (4, 4))
    params = select_parameters(model, exclude_token_embedding=True)
    fisher = mean_gradient_statistic(model, iter(batches), params, batch_contrastive_loss, "square")
    manual = {name: torch.zeros_like(p) for name, p in params.items()}
    for batch in batches:
        loss = model(**batch, return_loss=True).loss  # the model's own loss: one process, same positives
        assert torch.allclose(loss, batch_contrastive_loss(model, batch))
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for name, grad in zip(params, grads, strict=True):
            if grad is not None:
                manual[name] += grad**2 / len(batches)
    for name in params:
        assert torch.allclose(fisher[name], manual[name], rtol=1e-4, atol=1e-12), name
    assert fisher["logit_scale"].item() > 0 and model.training


def test_ewc_on_task_end_online_update(monkeypatch):
    model = tiny_clip(seed=2)
    batches = _batches(1, (4, 4))
    ewc = EWC({"gamma": 0.5, "fisher_batch_size": 4, "exclude_token_embedding": True})
    monkeypatch.setattr("hf_ccl.methods.ewc.task_batches", lambda *args, **kwargs: iter(batches))
    context = _context(model)
    ewc.on_task_end(context)
    first = {name: f.clone() for name, f in ewc.penalty.importance.items()}
    assert "text_model.embeddings.token_embedding.weight" not in first
    anchored = model.text_projection.weight.detach().clone()
    with torch.no_grad():
        model.text_projection.weight.add_(0.1)
    assert ewc.loss_terms(model, {}, None, context)["penalty"].item() > 0
    with torch.no_grad():
        model.text_projection.weight.copy_(anchored)  # back at θ*: the same F_t again
    ewc.on_task_end(context)
    for name, value in ewc.penalty.importance.items():
        assert torch.allclose(value, 1.5 * first[name], rtol=1e-5, atol=1e-12), name  # γF + F_t, γ = 0.5
        assert torch.equal(ewc.penalty.anchor[name], dict(model.named_parameters())[name])
    assert ewc.loss_terms(model, {}, None, context)["penalty"].item() == 0.0


def test_importance_pass_needs_the_task_data():
    with pytest.raises(
        ValueError, match="context.collator .*missing: \\['collator', 'train_dataset'\\]"
    ):
        EWC().on_task_end(_context(tiny_clip()))


# ----- SI -----------------------------------------------------------------------------------------------------------
def _step(model: nn.Module, si: SI, grad: list[float], after: list[float]) -> None:
    """One optimizer step driven by hand: gradient, the hook, then the new parameters."""
    model.a.grad = torch.tensor(grad)
    si.pre_optimizer_step(model, None)
    with torch.no_grad():
        model.a.copy_(torch.tensor(after))


def test_si_path_integral_on_a_two_step_trajectory():
    model = _Two([1.0, 2.0], [0.0])
    model.b.requires_grad_(False)
    si = SI({"c": 2.0, "xi": 0.1})
    si.on_task_start(None)
    _step(model, si, grad=[0.5, -1.0], after=[0.9, 2.2])
    _step(model, si, grad=[1.0, 1.0], after=[0.7, 2.1])
    si.on_task_end(_context(model))
    omega = torch.tensor([0.25, 0.3])  # −Σ_s g(s) (θ(s+1) − θ(s))
    delta = torch.tensor([0.7, 2.1]) - torch.tensor([1.0, 2.0])
    expected = omega / (delta**2 + 0.1)  # [1.3158, 2.7273]
    assert torch.allclose(si.penalty.importance["a"], expected)
    assert torch.equal(si.penalty.anchor["a"], torch.tensor([0.7, 2.1]))
    assert set(si.penalty.importance) == {"a"}
    with torch.no_grad():
        model.a.copy_(torch.tensor([0.7, 3.1]))
    term = si.loss_terms(model, {}, None, None)["penalty"]
    assert term.item() == pytest.approx(2.0 * expected[1].item())  # c Σ Ω (θ − θ*)²

    si.on_task_start(None)  # task 2: a step without gradient adds nothing; Ω accumulates
    model.a.grad = None
    si.pre_optimizer_step(model, None)
    si.on_task_end(_context(model))
    assert torch.allclose(si.penalty.importance["a"], expected)
    assert torch.equal(si.penalty.anchor["a"], torch.tensor([0.7, 3.1]))


def test_si_row_tracking_matches_dense_tracking():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, 2, generator=generator)
    paths = [PathIntegral(["w"], [start], {"w"}), PathIntegral(["w"], [start], set())]
    assert paths[0].by_rows == [0] and paths[1].dense == [0]
    steps = []
    for step in range(4):
        grad = torch.zeros(6, 2)
        grad[[step, step + 1]] = torch.randn(2, 2, generator=generator)
        if step == 2:
            grad[5, 0] = float("inf")  # an fp16 overflow: the step is skipped, nothing moves
        move = torch.zeros(6, 2) if step == 2 else 0.1 * torch.randn(6, 2, generator=generator)
        steps.append((grad, move))
    results = []
    for path in paths:
        param = nn.Parameter(start.clone())
        for grad, move in steps:
            param.grad = grad.clone()
            path.record([param])
            with torch.no_grad():
                param.add_(move)  # every row moves (Adam momentum), only some have a gradient
        results.append(path.importance([param], xi=0.1)["w"])
    assert torch.isfinite(results[0]).all()
    assert torch.allclose(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_si_path_integral_equals_the_plain_formula_bitwise():
    """The in-place bookkeeping (no model-sized temporaries) gives exactly ω = −Σ_s g(s) ⊙ (θ(s+1) − θ(s)), non-finite
    gradient entries counted as 0, through a mid-task close (a checkpoint) and a parameter without a gradient."""
    generator = torch.Generator().manual_seed(1)
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((5, 3), (7,), (2, 2, 2))]
    start = [p.detach().clone() for p in params]
    path = PathIntegral(["a", "b", "c"], params)
    omega = [torch.zeros_like(p) for p in params]
    for step in range(5):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        grads[0][0, 0] = float("nan") if step == 1 else grads[0][0, 0]
        before = [p.detach().clone() for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = None if step == 3 and p is params[2] else grad.clone()
        path.record(params)
        with torch.no_grad():
            for p in params:
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
        if step == 2:
            path.close(params)  # what SI's state_dict does mid-task
        for i, p in enumerate(params):
            g = torch.zeros_like(p) if p.grad is None else torch.nan_to_num(grads[i], nan=0.0, posinf=0.0, neginf=0.0)
            omega[i].addcmul_(g, p.detach() - before[i], value=-1.0)
    result = path.importance(params, xi=0.1)
    for name, p, w, s0 in zip("abc", params, omega, start, strict=True):
        delta = p.detach() - s0
        assert torch.equal(result[name], w / (delta * delta + 0.1)), name


# ----- MAS ----------------------------------------------------------------------------------------------------------
def test_mas_importance_is_the_mean_absolute_per_example_gradient():
    model = tiny_clip(seed=3)
    batches = _batches(2, (3, 2))
    mas = MAS({"exclude_token_embedding": True})
    params = mas.covered_parameters(model)
    per_example = mean_gradient_statistic(model, iter(batches), params, squared_embedding_norms, "abs", True)
    per_batch = mean_gradient_statistic(model, iter(batches), params, squared_embedding_norms, "abs", False)
    manual = {name: torch.zeros_like(p) for name, p in params.items()}
    manual_batch = {name: torch.zeros_like(p) for name, p in params.items()}
    for batch in batches:
        images = model.get_image_features(pixel_values=batch["pixel_values"])
        texts = model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        images = getattr(images, "pooler_output", images)
        texts = getattr(texts, "pooler_output", texts)
        norms = images.pow(2).sum(-1) + texts.pow(2).sum(-1)
        for k in range(len(norms)):
            grads = torch.autograd.grad(norms[k], list(params.values()), retain_graph=True, allow_unused=True)
            for name, grad in zip(params, grads, strict=True):
                if grad is not None:
                    manual[name] += grad.abs() / 5
        grads = torch.autograd.grad(norms.mean(), list(params.values()), allow_unused=True)
        for name, grad in zip(params, grads, strict=True):
            if grad is not None:
                manual_batch[name] += grad.abs() / 2
    for name in params:
        assert torch.allclose(per_example[name], manual[name], rtol=1e-4, atol=1e-6), name
        assert torch.allclose(per_batch[name], manual_batch[name], rtol=1e-4, atol=1e-6), name
    assert per_example["logit_scale"].item() == 0.0  # not part of the embeddings
    assert per_example["visual_projection.weight"].abs().sum() > 0


# ----- a real 2-task stream -----------------------------------------------------------------------------------------
def test_methods_on_a_real_stream_and_state_round_trip(tmp_path, clip_tokenizer):
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=10)
    stream.tasks = stream.tasks[:2]

    def methods():
        return [
            EWC({"fisher_batch_size": 8, "fisher_max_batches": 2}),
            SI(),
            MAS({"importance_batch_size": 4, "importance_max_batches": 2}),
        ]

    args = ContinualArguments(
        output_dir=str(tmp_path),
        training={
            "max_steps": 3,
            "per_device_train_batch_size": 16,
            "logging_steps": 1,
            "learning_rate": 1e-3,
            "warmup_steps": 0,  # every step moves the weights (SI's path integral needs all three)
            "lr_scheduler_type": "linear",
            "weight_decay": 0.0,
        },
        progress=False,
        evaluation={"initial": False},
    )
    trained = methods()
    recorder = TrainingLogRecorder()
    learner = ContinualLearner(tiny_clip(seed=0), stream, trained, load_image_processor(32), clip_tokenizer, args,
                               task_callbacks=[recorder])
    learner.fit()
    for method in ("ewc", "si", "mas"):
        per_task = [[log[f"loss/{method}/penalty"] for log in logs if "loss" in log] for logs in recorder.logs]
        assert len(per_task[0]) == 3 and all(value == 0.0 for value in per_task[0]), method
        assert per_task[1][0] == 0.0 and max(per_task[1]) > 0.0, method  # θ = θ* before task 1's first step
    for method in trained:
        assert method.penalty and method.tasks_consolidated == 2

    restored = methods()
    load_method_states(restored, tmp_path / "task-1")  # written by the learner
    save_method_states(restored, tmp_path)  # and once more, by hand
    again = methods()
    load_method_states(again, tmp_path)
    shifted = tiny_clip(seed=5)
    for original, copy in zip(trained, again, strict=True):
        assert copy.tasks_consolidated == 2
        assert set(copy.penalty.importance) == set(original.penalty.importance)
        for name, value in original.penalty.importance.items():
            assert torch.equal(copy.penalty.importance[name], value.cpu())
            assert torch.equal(copy.penalty.anchor[name], original.penalty.anchor[name].cpu())
        assert copy.penalty.value(shifted).item() == pytest.approx(original.penalty.value(shifted).item())


def _two_process_importances(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: EWC and MAS importances of a digits task, saved to `out`."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        torch.save(_importances(), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _importances() -> dict[str, dict[str, torch.Tensor]]:
    from hf_ccl.data import load_tokenizer

    stream = build_stream("digits", max_train_per_task=40, max_eval_per_task=4)
    collator = CLIPCollator(load_image_processor(32), load_tokenizer(), train=False)
    context = _context(tiny_clip(seed=0), collator=collator, train_dataset=stream[0].train)
    ewc = EWC({"fisher_batch_size": 8, "fisher_max_batches": 3})
    mas = MAS({"importance_batch_size": 4, "importance_max_batches": 3})
    ewc.on_task_end(context)
    mas.on_task_end(context)
    return {"ewc": ewc.penalty.importance, "mas": mas.penalty.importance}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_estimate_what_one_does(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_two_process_importances, args=(port, str(tmp_path)), nprocs=2)
    one = _importances()
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for method, importance in one.items():
        for name, value in importance.items():
            assert torch.equal(ranks[0][method][name], ranks[1][method][name]), (method, name)
            assert torch.allclose(ranks[0][method][name], value, rtol=1e-4, atol=1e-10), (method, name)
