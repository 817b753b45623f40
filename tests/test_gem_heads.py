"""GEM and A-GEM on learner heads (pair tasks, CMCL's setting; specs/cmcl.md §4): `hf_ccl.methods.gem` on
`learner_heads.heads.<modality>`, its hooks driven by hand on a real `ContinualCLIPModel` with heads, and through the
one loop (`ContinualLearner` with `learner_heads` + `gem`). Ported from the pairs package's GEM / A-GEM tests."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from datasets import Dataset

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import Task, TaskStream, load_image_processor
from hf_ccl.heads import LearnerHeads
from hf_ccl.methods import build_methods, load_method_states, save_method_states
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.gem import AGEM, GEM, EpisodicMemoryMethod
from hf_ccl.methods.gem_projection import flat_grad, gem_project, write_flat_grad
from hf_ccl.pair_features import FEATURE_COLUMNS, PairFeatureCollator
from hf_ccl.testing import StopAfterTask, TrainingLogRecorder, tiny_clip
from hf_ccl.validation import ConfigError

D, N = 8, 48
TEMPERATURE = 0.2


@pytest.fixture
def one_thread():
    """Tiny heads and a tiny CLIP: one intra-op thread is several times faster than threads that wait on each other
    (on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- a toy stream of cached features, and a CLIP with heads --------------------------------------------------------
def toy_stream(pairs: Sequence[tuple[str, str]], seed: int = 0) -> TaskStream:
    """Encoded pair tasks (`FEATURE_COLUMNS`, as the loop makes them) whose b side is a random rotation of the a side
    plus noise, unit-norm rows: identity heads align them badly, so every task has to move its heads."""
    generator = torch.Generator().manual_seed(seed)
    tasks = []
    for index, (a, b) in enumerate(pairs):
        xa = torch.nn.functional.normalize(torch.randn(N, D, generator=generator), dim=-1)
        rotation, _ = torch.linalg.qr(torch.randn(D, D, generator=generator))
        xb = torch.nn.functional.normalize(xa @ rotation.T + 0.1 * torch.randn(N, D, generator=generator), dim=-1)
        split = Dataset.from_dict({"features_a": xa.numpy(), "features_b": xb.numpy()}).with_format("torch")
        tasks.append(Task(f"task{index}", split, split.select(range(8)), kind="pair", modalities=(a, b),
                          columns=FEATURE_COLUMNS))
    return TaskStream("toy", tasks)


def model_with_heads(stream: TaskStream, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A frozen tiny CLIP with identity heads for every modality of the stream (as `learner_heads` attaches them)."""
    model = tiny_clip(seed=0).to(dtype)
    model.requires_grad_(False)
    model.learner_heads = LearnerHeads(D, stream.modalities, temperature=TEMPERATURE, fold=None).to(dtype)
    return model


def start_task(method: EpisodicMemoryMethod | None, model: torch.nn.Module, stream: TaskStream, index: int,
               step: int = 0) -> TaskContext:
    """The context of task `index` with only its pair's heads trainable (as `learner_heads` leaves them), after the
    method's `on_task_start`."""
    task = stream[index]
    context = TaskContext(index, task, stream, model, global_step=step)
    context.collator, context.train_dataset = PairFeatureCollator(task.modalities), task.train
    model.learner_heads.train_only(task.modalities)
    if method is not None:
        method.on_task_start(context)
    return context


def pair_loss(model: torch.nn.Module, task: Task, rows: Sequence[int] | slice = slice(None),
              features: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Eq. 2 of CMCL on the given rows of `task`'s features (read from its split unless given), through the model
    (features in the heads' dtype)."""
    features = task.train[:] if features is None else features
    dtype = model.learner_heads.heads[task.modalities[0]].weight.dtype
    return model(features_a=features["features_a"][rows].to(dtype), features_b=features["features_b"][rows].to(dtype),
                 modality_a=task.modalities[0], modality_b=task.modalities[1], return_loss=True).loss


def finish_tasks(method: EpisodicMemoryMethod, model: torch.nn.Module, stream: TaskStream, count: int) -> None:
    """`on_task_end` of the first `count` tasks, the task's heads moved a little before each (as training would)."""
    for index in range(count):
        context = start_task(method, model, stream, index)
        generator = torch.Generator().manual_seed(10 + index)
        with torch.no_grad():
            for modality in stream[index].modalities:
                weight = model.learner_heads.heads[modality].weight
                weight.add_(0.1 * torch.randn(weight.shape, generator=generator))
        method.on_task_end(context)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train (the current pair's heads), in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def hand_gradient(params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, materialize_grads=True)])


def set_gradient(model: torch.nn.Module, g: torch.Tensor) -> list[torch.nn.Parameter]:
    """Every head's `.grad` cleared, then the trainable ones set to the flat `g`; returns those parameters."""
    model.zero_grad(set_to_none=True)
    params = trainable(model)
    write_flat_grad(params, g.clone())
    return params


def round_trip(method: EpisodicMemoryMethod, folder) -> EpisodicMemoryMethod:
    """Through the project's method-state files (JSON + safetensors), into a fresh instance."""
    save_method_states([method], folder)
    fresh = type(method)(method.config)
    load_method_states([fresh], folder)
    return fresh


# ----- GEM on heads ---------------------------------------------------------------------------------------------------
def test_gem_projects_the_head_gradient_and_skips_unrelated_tasks(tmp_path):
    """G holds the pair-loss gradients of the past tasks sharing a head with (a, b), each batched with its own
    modalities; (d, e) shares none (g_k = 0) and is skipped; the step is GEM's dual QP (Eqs. 12–13, margin 0.5,
    ε 1e-3), frozen heads are untouched, and a restored method projects identically."""
    stream = toy_stream([("a", "b"), ("a", "c"), ("d", "e"), ("a", "b")])
    model = model_with_heads(stream)
    method = GEM({"memory_per_task": 12})
    finish_tasks(method, model, stream, 3)
    assert [(m.task_index, m.task_name, len(m), len(set(m.rows))) for m in method.memories] == [
        (0, "task0", 12, 12), (1, "task1", 12, 12), (2, "task2", 12, 12)]
    assert all(max(m.rows) < N for m in method.memories)
    context = start_task(method, model, stream, 3, step=5)
    params = trainable(model)
    assert method.selected_parameters(model)[0] == ["learner_heads.heads.a.weight", "learner_heads.heads.b.weight"]
    memories, G = method.memory_gradients(model, context, params)
    assert [m.task_index for m in memories] == [0, 1]
    by_hand = torch.stack([hand_gradient(params, pair_loss(model, stream[m.task_index], m.rows)) for m in memories])
    torch.testing.assert_close(G, by_hand)
    batch = method.memory_batch(context, [(memories[1], None)], torch.device("cpu"))
    assert (batch["modality_a"], batch["modality_b"]) == ("a", "c")  # its own pair, not the current one
    assert method.rows_per_step(model, context, params) == 24.0

    g = -G[0] + 0.1 * G[1]  # violates task 0's constraint
    set_gradient(model, g)
    method.pre_optimizer_step(model, context)
    expected, v = gem_project(g, G, margin=0.5, eps=1e-3)
    torch.testing.assert_close(flat_grad(params), expected, rtol=1e-5, atol=1e-6)
    assert bool((G @ flat_grad(params) >= -1e-3 * v.float() - 1e-5).all())
    metrics = method.metrics()
    assert metrics["constraints"] == 2.0 and metrics["violations"] >= 1.0 and metrics["projected"] == 1.0
    assert metrics["dual_max"] == pytest.approx(float(v.max()))
    assert all(model.learner_heads.heads[m].weight.grad is None for m in "cde")  # frozen heads untouched

    resumed = round_trip(method, tmp_path)
    assert resumed.memories == method.memories
    set_gradient(model, g)
    resumed.on_task_start(context)
    resumed.pre_optimizer_step(model, context)
    torch.testing.assert_close(flat_grad(params), expected, rtol=1e-5, atol=1e-6)


def test_gem_leaves_a_compatible_gradient_alone():
    stream = toy_stream([("a", "b"), ("c", "d"), ("a", "b"), ("e", "f")])
    model = model_with_heads(stream)
    method = GEM({"memory_per_task": 12})
    finish_tasks(method, model, stream, 3)
    context = start_task(method, model, stream, 2)
    params = trainable(model)
    memory = method.memories[0]
    g_0 = hand_gradient(params, pair_loss(model, stream[0], memory.rows))
    set_gradient(model, g_0)  # ⟨g, g₀⟩ > 0: no violation
    before = flat_grad(params).clone()
    method.pre_optimizer_step(model, context)
    assert torch.equal(flat_grad(params), before)
    metrics = method.metrics()
    assert metrics["constraints"] == 1.0  # task 1 = (c, d) shares no head
    assert metrics["violations"] == 0.0 and metrics["projected"] == 0.0
    # A pair sharing no head with any past task: no constraint at all, g untouched.
    context = start_task(method, model, stream, 3)
    params = set_gradient(model, -torch.ones(2 * D * D))
    method.pre_optimizer_step(model, context)
    assert torch.equal(flat_grad(params), -torch.ones(2 * D * D)) and method.metrics()["constraints"] == 0.0
    assert method.rows_per_step(model, context, params) == 0.0
    # The first task has no memory: nothing to do.
    fresh = GEM()
    context = start_task(fresh, model, stream, 0)
    params = set_gradient(model, g_0)
    fresh.pre_optimizer_step(model, context)
    assert torch.equal(flat_grad(params), g_0)


# ----- A-GEM on heads -------------------------------------------------------------------------------------------------
def test_agem_on_heads_matches_the_hand_formula(tmp_path):
    """g_ref is ∇ Σ_k (n_k / n) L_k over the tasks drawn (one batch per task, its own heads; (d, e) adds 0), and the
    step is Eq. 11; the draw is seeded by the step and survives a state round trip."""
    stream = toy_stream([("a", "b"), ("a", "c"), ("d", "e"), ("c", "a"), ("f", "g")])
    model = model_with_heads(stream)
    method = AGEM({"memory_per_task": 10, "reference_batch_size": 100})  # ≥ all 30 rows: the whole memory
    finish_tasks(method, model, stream, 3)
    context = start_task(method, model, stream, 3, step=3)
    params = trainable(model)
    parts, _ = method.reference_rows(context)
    assert [(m.task_index, len(positions)) for m, positions in parts] == [(0, 10), (1, 10), (2, 10)]
    m0, m1, _ = method.memories
    g_ref = hand_gradient(params, (pair_loss(model, stream[0], m0.rows) + pair_loss(model, stream[1], m1.rows)) / 3)
    torch.testing.assert_close(method.reference_gradient(model, context, params), g_ref)
    assert method.rows_per_step(model, context, params) == 20.0  # (d, e)'s drawn rows are not encoded

    g = -g_ref + 0.3 * torch.randn(g_ref.shape, generator=torch.Generator().manual_seed(0))
    assert float(g @ g_ref) < 0
    set_gradient(model, g)
    method.pre_optimizer_step(model, context)
    torch.testing.assert_close(flat_grad(params), g - (g @ g_ref) / (g_ref @ g_ref) * g_ref, rtol=1e-5, atol=1e-6)
    assert float(flat_grad(params) @ g_ref) >= -1e-5
    assert method.metrics()["projected"] == 1.0 and method.metrics()["ref_cosine"] < 0
    set_gradient(model, g_ref)  # compatible: unchanged
    method.pre_optimizer_step(model, context)
    assert torch.equal(flat_grad(params), g_ref) and method.metrics()["projected"] == 0.0

    # A smaller reference batch: seeded by the step, uniform over all memories, the same after a resume.
    small = AGEM({"memory_per_task": 10, "reference_batch_size": 7})
    small.load_state_dict(method.state_dict())
    first = [(m.task_index, positions.tolist()) for m, positions in small.reference_rows(context)[0]]
    assert sum(len(positions) for _, positions in first) == 7
    again = round_trip(small, tmp_path).reference_rows(context)[0]
    assert first == [(m.task_index, positions.tolist()) for m, positions in again]
    context.global_step = 4
    assert first != [(m.task_index, positions.tolist()) for m, positions in small.reference_rows(context)[0]]

    # A pair sharing no head with any drawn task: g_ref = 0, nothing projected.
    context = start_task(method, model, stream, 4)
    params = set_gradient(model, -torch.ones(2 * D * D))
    method.pre_optimizer_step(model, context)
    assert torch.equal(flat_grad(params), -torch.ones(2 * D * D))
    assert method.metrics()["projected"] == 0.0 and method.metrics()["ref_cosine"] == 0.0


def test_gem_and_agem_run_after_learner_heads():
    for name in ("gem", "agem"):
        with pytest.raises(ConfigError, match=rf"Put '{name}' after 'learner_heads'.*learner heads"):
            build_methods([name, "learner_heads"])
        methods = build_methods(["learner_heads", name])
        assert methods[1].trains_pair_tasks


# ----- forgetting on a conflicting toy stream -------------------------------------------------------------------------
PAIRS = [("a", "b"), ("a", "c"), ("c", "b")]


def train_stream(method: EpisodicMemoryMethod | None, seed: int, steps: int = 20, lr: float = 0.5,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, TaskStream, float]:
    """The hooks by hand on PAIRS: per step the pair loss of 16 random rows, backward, `pre_optimizer_step`, an SGD
    step on the trainable heads; `on_task_end` after each task (None: plain training, no method). Returns the
    model, the stream and task 0's loss right after task 0."""
    stream = toy_stream(PAIRS, seed)
    model = model_with_heads(stream, dtype)
    after_first = float("nan")
    for index, task in enumerate(stream):
        context = start_task(method, model, stream, index)
        features, generator = task.train[:], torch.Generator().manual_seed(100 + index)
        for step in range(steps):
            context.global_step = step
            model.zero_grad(set_to_none=True)
            pair_loss(model, task, torch.randperm(N, generator=generator)[:16], features).backward()
            if method is not None:
                method.pre_optimizer_step(model, context)
            with torch.no_grad():
                for p in trainable(model):
                    assert p.grad.dtype == dtype
                    p.sub_(lr * p.grad)
        if method is not None:
            method.on_task_end(context)
        if index == 0:
            after_first = first_task_loss(model, stream)
    return model, stream, after_first


def first_task_loss(model: torch.nn.Module, stream: TaskStream) -> float:
    with torch.no_grad():
        return float(pair_loss(model, stream[0]))


def forgetting(method: EpisodicMemoryMethod | None, seed: int) -> float:
    """How much task 0's loss grew from the end of task 0 to the end of the stream."""
    model, stream, after_first = train_stream(method, seed)
    return first_task_loss(model, stream) - after_first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gem_and_agem_forget_task_one_less_than_plain_training(seed: int, one_thread):
    """(a, b), then (a, c) and (c, b) pull the a and b heads elsewhere: the growth of task 0's loss under GEM (margin
    0.5) is under 0.6 of plain training's, under A-GEM (one averaged constraint, no margin) under 0.9 (over seeds
    0–7: at most 0.57 and 0.83); GEM constrains task 2 by both earlier tasks."""
    plain = forgetting(None, seed)
    gem = GEM({"memory_per_task": 16})
    gem_forgetting = forgetting(gem, seed)
    agem_forgetting = forgetting(AGEM({"memory_per_task": 16, "reference_batch_size": 16}), seed)
    assert plain > 1.0
    assert gem_forgetting < 0.6 * plain, (gem_forgetting, plain)
    assert agem_forgetting < 0.9 * plain, (agem_forgetting, plain)
    assert gem.metrics()["constraints"] == 2.0


@pytest.mark.parametrize("method_class", [GEM, AGEM])
def test_memory_gradients_follow_the_heads_dtype(method_class: type[EpisodicMemoryMethod], one_thread):
    """float64 heads on float32 cached features: the memory batches are cast to the heads' dtype."""
    method = method_class({"memory_per_task": 16})
    model, stream, _ = train_stream(method, seed=0, steps=3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.learner_heads.parameters())
    context = start_task(method, model, stream, 2)
    params = trainable(model)
    gradient = (method.memory_gradients(model, context, params)[1] if method_class is GEM
                else method.reference_gradient(model, context, params))
    assert gradient.dtype == torch.float64 and bool(torch.isfinite(gradient).all()) and bool(gradient.abs().sum() > 0)


# ----- through the loop -----------------------------------------------------------------------------------------------
TRAINING = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "logging_steps": 1}


def _learner(stream: TaskStream, folder, methods: list[str], options: dict, tokenizer, **args) -> ContinualLearner:
    arguments = ContinualArguments(output_dir=str(folder), training=dict(TRAINING), progress=False, **args)
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods(methods, options), load_image_processor(32),
                            tokenizer, arguments, task_callbacks=[TrainingLogRecorder()])


@pytest.mark.parametrize("name", ["gem", "agem"])
def test_loop_constrains_the_heads_and_resumes_exactly(pair_stream, clip_tokenizer, tmp_path, name, one_thread):
    """[learner_heads, gem] on the flickr pairs (image-en, en-de, image-de): task 1 is constrained by task 0 (they
    share en), task 2 by both; the memories are in the task checkpoints; a run stopped after task 1 and resumed ends
    with the same heads, memories and results (A-GEM: its draws are seeded by the step)."""
    methods, options = ["learner_heads", name], {name: {"memory_per_task": 32}}
    if name == "agem":
        options[name]["reference_batch_size"] = 16
    full = _learner(pair_stream, tmp_path / "full", methods, options, clip_tokenizer, save_checkpoints=False)
    full.fit()
    method = full.methods[1]
    assert [(m.task_index, len(m)) for m in method.memories] == [(0, 32), (1, 32), (2, 32)]
    logs = [full.task_callbacks.get(TrainingLogRecorder).step_logs(index) for index in range(3)]
    if name == "gem":  # a step's log holds the metrics of the step before
        assert [log["gem/constraints"] for log in logs[1][1:]] == [1.0] * (len(logs[1]) - 1)
        assert [log["gem/constraints"] for log in logs[2][1:]] == [2.0] * (len(logs[2]) - 1)
    else:
        assert any(log["agem/ref_cosine"] != 0.0 for log in logs[2][1:])

    cut = _learner(pair_stream, tmp_path / "cut", methods, options, clip_tokenizer)
    cut.task_callbacks.add([StopAfterTask(1)])
    cut.fit()
    assert len(cut.results.rows) == 2
    saved = build_methods(methods, options)
    load_method_states(saved, tmp_path / "cut" / "task-1")  # written by the loop
    assert saved[1].memories == method.memories[:2]
    resumed = _learner(pair_stream, tmp_path / "cut", methods, options, clip_tokenizer, resume_from_checkpoint=True)
    resumed.fit()
    for key, value in full.model.learner_heads.state_dict().items():
        assert torch.allclose(value, resumed.model.learner_heads.state_dict()[key], atol=1e-6), key
    assert resumed.methods[1].memories == method.memories
    assert resumed.results.rows[-1].to_dict() == full.results.rows[-1].to_dict()
