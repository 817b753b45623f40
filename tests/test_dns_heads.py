"""DNS on learner heads (pair tasks, CMCL's own setting; specs/cmcl.md §2.5): `hf_ccl.methods.dns` on
`learner_heads.heads.<modality>`, with its hooks driven by hand on a real `ContinualCLIPModel` and through the one
loop (`ContinualLearner` with `learner_heads` + `dns`). Ported from the pairs package's DNS tests."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import Task, TaskStream, load_image_processor
from hf_ccl.heads import LearnerHeads
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.dns import DNS
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.pair_features import FEATURE_COLUMNS, PairFeatureCollator
from hf_ccl.testing import StopAfterTask, TrainingLogRecorder, tiny_clip
from hf_ccl.validation import ConfigError

DIM = 32  # tiny_clip's projection_dim: the heads' width in the loop
TRAINING = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "logging_steps": 1}
SGD = {"optim": "sgd", "weight_decay": 0.0, "lr_scheduler_type": "constant", "per_device_train_batch_size": 16,
       "logging_steps": 1}


def _low_rank(n: int, d: int, rank: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, rank, generator=generator) @ torch.randn(rank, d, generator=generator)


def _gaussian(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


# ----- the hooks by hand, on a real model with heads ------------------------------------------------------------------
def _encoded_task(name: str, a: str, b: str, xa: torch.Tensor, xb: torch.Tensor) -> Task:
    """A pair task whose splits are already cached features (`FEATURE_COLUMNS`), as the loop makes them."""
    split = Dataset.from_dict({"features_a": xa.numpy(), "features_b": xb.numpy()}).with_format("torch")
    return Task(name, split, split, kind="pair", modalities=(a, b), columns=FEATURE_COLUMNS)


def _model_with_heads(d: int, modalities: list[str]) -> torch.nn.Module:
    model = tiny_clip(seed=0)
    model.requires_grad_(False)
    model.learner_heads = LearnerHeads(d, modalities, fold=None)
    return model


def _context(model: torch.nn.Module, task: Task, index: int = 0, batch_size: int = 16) -> TaskContext:
    context = TaskContext(index, task, TaskStream("by-hand", [task]), model)
    context.collator, context.train_dataset = PairFeatureCollator(task.modalities), task.train
    context.per_device_batch_size = batch_size
    return context


def _loss(model: torch.nn.Module, task: Task) -> torch.Tensor:
    rows = task.train[:]
    return model(features_a=rows["features_a"], features_b=rows["features_b"], modality_a=task.modalities[0],
                 modality_b=task.modalities[1], return_loss=True).loss


def _learn(method: DNS | None, model: torch.nn.Module, task: Task, steps: int, lr: float, index: int) -> None:
    """`steps` plain SGD steps on the whole task through the method's hooks (None: no method), then its task end."""
    model.learner_heads.train_only(task.modalities)
    context = _context(model, task, index)
    if method is not None:
        method.on_task_start(context)
    for _ in range(steps):
        model.zero_grad()
        _loss(model, task).backward()
        if method is not None:
            method.pre_optimizer_step(model, context)
        with torch.no_grad():
            for p in model.learner_heads.parameters():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
        if method is not None:
            method.post_optimizer_step(model, context)
    if method is not None:
        method.on_task_end(context)


def _alignment(model: torch.nn.Module, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.learner_heads("a", "b", xa, xb, return_loss=False)
    return out.z_a.double() @ out.z_b.double().T


@pytest.mark.parametrize("second_pair", [("a", "b"), ("a", "c")])
def test_dns_moves_old_alignments_only_at_second_order(second_pair):
    """Thm. 4/5: after a projected SGD step of size η the old alignment matrix moves O(η²) (exactly 0 when only one
    of the old pair's heads moves); an unprojected step moves it O(η). A head never seen (c) trains unprojected while
    its seen partner is projected (A15)."""
    d = 8
    xa, xb = _low_rank(40, d, 3, 0), _low_rank(40, d, 3, 1)
    first = _encoded_task("t0", "a", "b", xa, xb)
    second = _encoded_task("t1", *second_pair, _gaussian(40, d, 2), _gaussian(40, d, 3))
    drifts = {}
    for name in ("dns", "vanilla"):
        for lr in (1e-2, 5e-3):
            model = _model_with_heads(d, ["a", "b", "c"])
            method = DNS({"threshold_in": 1e-9, "threshold_out": 1e-9})
            _learn(method, model, first, steps=5, lr=0.05, index=0)
            before = _alignment(model, xa, xb)
            _learn(method if name == "dns" else None, model, second, steps=1, lr=lr, index=1)
            drifts[name, lr] = float((_alignment(model, xa, xb) - before).norm() / before.norm())
            if name == "dns":
                projected = {f"learner_heads.heads.{m}" for m in second_pair if m != "c"}
                assert set(method.ranks) == projected
                assert method.ranks["learner_heads.heads.a"] == {"in": 3, "out": 3}
    assert drifts["vanilla", 1e-2] / drifts["vanilla", 5e-3] == pytest.approx(2.0, rel=0.05)  # first order
    assert drifts["dns", 1e-2] < 1e-2 * drifts["vanilla", 1e-2]
    if second_pair == ("a", "c"):
        assert drifts["dns", 1e-2] < 1e-6  # W_b does not move: no η² cross term (float32 round-off only)
    else:
        assert drifts["dns", 1e-2] / drifts["dns", 5e-3] == pytest.approx(4.0, rel=0.05)  # second order


def test_dns_covariances_follow_alg1_and_the_official_preset():
    """Alg. 1 l.16-18 by hand: C_in[a] = Xaᵀ Xa / n, C_out[a] = Ybᵀ Yb / n with Y = X Wᵀ (the PARTNER's bias-free
    outputs, A2, A17), running means over tasks (Thm. 8) with per-modality counts, or one global count (A5)."""
    d = 4
    xa, xb, more_a, more_c = (_gaussian(n, d, seed) for seed, n in enumerate((10, 10, 30, 30)))
    model = _model_with_heads(d, ["a", "b", "c"])
    w = {m: torch.randn(d, d, generator=torch.Generator().manual_seed(10 + i)) for i, m in enumerate("abc")}
    with torch.no_grad():
        for m, weight in w.items():
            model.learner_heads.heads[m].weight.copy_(weight)
    first, second = _encoded_task("t0", "a", "b", xa, xb), _encoded_task("t1", "a", "c", more_a, more_c)

    def gram(x: torch.Tensor, m: str | None = None) -> torch.Tensor:
        y = x.double() if m is None else x.double() @ w[m].double().T
        return y.T @ y

    method = DNS({"covariance_batch_size": 4})  # several batches, the last one short: sums merge exactly
    method.on_task_end(_context(model, first))
    stored = method.covariances
    assert set(stored) == {"learner_heads.heads.a", "learner_heads.heads.b"}  # c was absent (A15)
    a, b, c = (stored.get(f"learner_heads.heads.{m}") for m in "abc")
    torch.testing.assert_close(a["in"], gram(xa) / 10)
    torch.testing.assert_close(a["out"], gram(xb, "b") / 10)  # the partner's outputs (A2)
    torch.testing.assert_close(b["in"], gram(xb) / 10)
    torch.testing.assert_close(b["out"], gram(xa, "a") / 10)
    method.on_task_end(_context(model, second, index=1))
    a, c = stored["learner_heads.heads.a"], stored["learner_heads.heads.c"]
    torch.testing.assert_close(a["in"], (gram(xa) + gram(more_a)) / 40)  # running mean (Thm. 8)
    torch.testing.assert_close(a["out"], (gram(xb, "b") + gram(more_c, "c")) / 40)  # every partner of a
    torch.testing.assert_close(c["out"], gram(more_a, "a") / 30)
    assert method.counts["learner_heads.heads.a"] == {"in": 40, "out": 40}
    assert method.counts["learner_heads.heads.b"] == {"in": 10, "out": 10}
    assert method.global_count == 40 and method.tasks_seen == 2

    official = DNS({"preset": "official"})
    assert official.config.threshold_out == 0.0 and official.config.counts == "global"
    official.on_task_end(_context(model, first))
    official.on_task_end(_context(model, second, index=1))
    # one global n̄ (A5): c, new in task 2, is normalised by all 40 rows seen so far, not by its own 30
    torch.testing.assert_close(official.covariances["learner_heads.heads.c"]["in"], gram(more_c) / 40)
    torch.testing.assert_close(stored["learner_heads.heads.c"]["in"], gram(more_c) / 30)
    torch.testing.assert_close(official.covariances["learner_heads.heads.a"]["in"], a["in"])  # a took part in both
    assert official.thresholds("learner_heads.heads.a") == (1e-4, 0.0)  # the heads' λ_min (unit-norm features)
    assert DNS().thresholds("visual_projection") == (0.01, 0.01)  # a CLIP's, unchanged


def test_layers_pick_heads_and_the_order_is_checked():
    """`layers` patterns choose heads (the partner still gives P_out); CLIP layers are refused on pair tasks; dns
    must come after learner_heads in the method list, and the error says so."""
    d = 4
    xa, xb = _gaussian(12, d, 0), _gaussian(12, d, 1)
    model = _model_with_heads(d, ["a", "b"])
    task = _encoded_task("t0", "a", "b", xa, xb)
    method = DNS({"layers": ["learner_heads.heads.a"], "threshold_in": 1e-9, "threshold_out": 1e-9})
    _learn(method, model, task, steps=2, lr=0.1, index=0)
    assert set(method.covariances) == {"learner_heads.heads.a"}
    y = xb.double() @ model.learner_heads.heads["b"].weight.detach().double().T
    torch.testing.assert_close(method.covariances["learner_heads.heads.a"]["out"], y.T @ y / 12)
    method.on_task_start(_context(model, task, index=1))
    assert set(method.ranks) == {"learner_heads.heads.a"}
    with pytest.raises(ValueError, match="match no nn.Linear.*learner heads"):
        DNS({"layers": ["visual_projection"]}).on_task_start(_context(model, task))
    with pytest.raises(ValueError, match="pair tasks"):
        DNS().on_task_start(TaskContext(0, None, None, model))
    with pytest.raises(ConfigError, match=r"Put 'dns' after 'learner_heads'.*\[learner_heads, dns\]"):
        build_methods(["dns", "learner_heads"])
    build_methods(["learner_heads", "dns"])


# ----- through the loop ------------------------------------------------------------------------------------------
def _vector_task(name: str, a: str, b: str, xa: torch.Tensor, xb: torch.Tensor) -> Task:
    rows = {a: xa.tolist(), b: xb.tolist()}
    return Task(name, Dataset.from_dict(rows), Dataset.from_dict(rows), kind="pair", modalities=(a, b))


def _vector_stream() -> TaskStream:
    """Two tasks of precomputed vectors: a low-rank old pair (room left for the null space), then a new one."""
    old = _vector_task("t0", "a", "b", _low_rank(32, DIM, 4, 0, 0.1), _low_rank(32, DIM, 4, 1, 0.1))
    new = _vector_task("t1", "a", "b", _gaussian(32, DIM, 2, 0.2), _gaussian(32, DIM, 3, 0.2))
    return TaskStream("vectors", [old, new])


def _learner(stream: TaskStream, tmp_path, methods, options, tokenizer, training, **args) -> ContinualLearner:
    arguments = ContinualArguments(output_dir=str(tmp_path), training=dict(training), progress=False, **args)
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods(list(methods), options), load_image_processor(32),
                            tokenizer, arguments, task_callbacks=[TrainingLogRecorder()])


def _drift(learner: ContinualLearner, task: str = "t0") -> float:
    return learner.results.rows[-1].metrics[task]["drift"]


def test_loop_dns_on_heads_is_second_order_under_sgd_and_plain_above_threshold(clip_tokenizer, tmp_path):
    """Through the loop with SGD: DNS (`project: update`, tiny λ_min) keeps the old task's alignment drift far below
    plain training's on the same stream, and halving η quarters it (second order) while plain training's halves;
    a threshold above every eigenvalue keeps nothing: exactly plain training."""
    stream = _vector_stream()
    vectors = {"pairs": {"precomputed_modalities": ["a", "b"]}, "evaluation": {"initial": False}, "save_checkpoints": False}
    unfolded = {"learner_heads": {"fold_image_modality": None, "fold_text_modality": None, "temperature": 1.0}}
    strict = {**unfolded, "dns": {"project": "update", "threshold_in": 1e-6, "threshold_out": 1e-6}}
    runs = {}
    for lr in (0.1, 0.05):
        training = {**SGD, "max_steps": 2, "learning_rate": lr}
        for name, methods, options in (("dns", ["learner_heads", "dns"], strict), ("plain", ["learner_heads"], unfolded)):
            learner = _learner(stream, tmp_path / f"{name}-{lr}", methods, options, clip_tokenizer, training, **vectors)
            learner.fit()
            runs[name, lr] = learner
    dns = runs["dns", 0.1].methods[1]
    assert dns.ranks == {"learner_heads.heads.a": {"in": 4, "out": 4}, "learner_heads.heads.b": {"in": 4, "out": 4}}
    logs = [log for log in runs["dns", 0.1].task_callbacks.get(TrainingLogRecorder).logs[1] if "dns/active" in log]
    assert logs and all(log["dns/active"] == 1.0 for log in logs)
    heads = {name: runs[name, 0.1].model.learner_heads for name in ("dns", "plain")}
    moved = (heads["dns"].heads["a"].weight - heads["dns"].snapshots["t0"]["heads.a.weight"]).norm()
    assert moved > 0.1 * (heads["plain"].heads["a"].weight - heads["plain"].snapshots["t0"]["heads.a.weight"]).norm()
    assert _drift(runs["dns", 0.1]) < 1e-2 * _drift(runs["plain", 0.1])
    assert _drift(runs["plain", 0.1]) / _drift(runs["plain", 0.05]) == pytest.approx(2.0, rel=0.15)  # first order
    assert _drift(runs["dns", 0.1]) / _drift(runs["dns", 0.05]) == pytest.approx(4.0, rel=0.15)  # second order

    training = {**SGD, "max_steps": 2, "learning_rate": 0.1}
    loose = {**unfolded, "dns": {"threshold_in": 1e6, "threshold_out": 1e6}}
    learner = _learner(stream, tmp_path / "loose", ["learner_heads", "dns"], loose, clip_tokenizer, training, **vectors)
    learner.fit()
    assert learner.methods[1].projectors == {} and learner.methods[1].tasks_seen == 2
    for name, value in runs["plain", 0.1].model.learner_heads.state_dict().items():
        assert torch.equal(learner.model.learner_heads.state_dict()[name], value), name


def test_loop_dns_keeps_old_alignments_saves_state_and_resumes_exactly(pair_stream, clip_tokenizer, tmp_path):
    """The flickr pair stream under AdamW with `project: update` (exact at first order, A7): each earlier task's
    drift stays well below plain training's; the state round-trips through the checkpoint files; a run stopped
    after task 1 and resumed finishes with the same heads, covariances and results."""
    options = {"dns": {"project": "update"}}
    methods = ["learner_heads", "dns"]
    full = _learner(pair_stream, tmp_path / "full", methods, options, clip_tokenizer, TRAINING)
    full.fit()
    plain = _learner(pair_stream, tmp_path / "plain", ["learner_heads"], {}, clip_tokenizer, TRAINING,
                     save_checkpoints=False)
    plain.fit()
    for name in pair_stream.task_names[:2]:
        assert 0 <= _drift(full, name) < 0.5 * _drift(plain, name), name
    dns = full.methods[1]
    assert set(dns.covariances) == {f"learner_heads.heads.{m}" for m in ("image", "en", "de")}
    assert dns.counts["learner_heads.heads.en"] == {"in": 128, "out": 128}  # image-en, then en-de
    assert dns.counts["learner_heads.heads.de"] == {"in": 128, "out": 128} and dns.global_count == 192

    restored = build_methods(methods, options)
    load_method_states(restored, tmp_path / "full" / "task-2")  # written by the loop
    save_method_states(restored, tmp_path)
    again = build_methods(methods, options)
    load_method_states(again, tmp_path)
    copy = again[1]
    assert copy.counts == dns.counts and copy.global_count == dns.global_count and copy.tasks_seen == 3
    for layer, sides in dns.covariances.items():
        for side, value in sides.items():
            assert torch.equal(copy.covariances[layer][side], value), (layer, side)
    copy.build_projectors()
    dns.build_projectors()
    assert copy.ranks == dns.ranks and dns.ranks

    cut = _learner(pair_stream, tmp_path / "cut", methods, options, clip_tokenizer, TRAINING)
    cut.task_callbacks.add([StopAfterTask(1)])
    cut.fit()
    assert len(cut.results.rows) == 2
    resumed = _learner(pair_stream, tmp_path / "cut", methods, options, clip_tokenizer, TRAINING,
                       resume_from_checkpoint=True)
    resumed.fit()
    for name, value in full.model.learner_heads.state_dict().items():
        assert torch.allclose(value, resumed.model.learner_heads.state_dict()[name], atol=1e-6), name
    again = resumed.methods[1]
    assert again.counts == dns.counts and again.global_count == dns.global_count
    for layer, sides in dns.covariances.items():
        for side, value in sides.items():
            assert torch.allclose(value, again.covariances[layer][side], atol=1e-9), (layer, side)
    assert resumed.results.rows[-1].to_dict() == full.results.rows[-1].to_dict()
