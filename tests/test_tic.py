"""TiC-CLIP's strategies (specs/ticclip.md §2): buffer sizes by hand, the pool each strategy trains on, samples
seen = budget, LR schedules, Restart's fresh init, Patching's interpolation and alpha search, state round trips."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import TrainerCallback

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import (
    CANONICAL_FEATURES,
    Task,
    TaskStream,
    build_stream,
    load_image_processor,
    load_tokenizer,
)
from hf_ccl.methods import build_methods, get_method_class
from hf_ccl.methods import patching as patching_module
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.patching import DEFAULT_ALPHAS, Patching, interpolate_state_dicts, select_alpha
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.methods.tic import Oracle, Restart, fresh_model
from hf_ccl.methods.tic_replay import CumulativeExp, buffer_sizes, retained_stream
from hf_ccl.testing import tiny_clip

RUN_SEED = 7


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: fake canonical tasks (no image decoding) and contexts as the loop builds them
# ----------------------------------------------------------------------------------------------------------------
def _fake_task(name: str, n: int) -> Task:
    rows = {
        "image": [{"bytes": f"{name}-{i}".encode(), "path": None} for i in range(n)],
        "texts": [[f"{name} {i}"] for i in range(n)],
        "image_id": [f"{name}/train/{i}" for i in range(n)],
        "label": [-1] * n,
    }
    train = Dataset.from_dict(rows, features=CANONICAL_FEATURES)
    return Task(name=name, train=train, eval=train)


def _stream(sizes: list[int]) -> TaskStream:
    return TaskStream("fake", [_fake_task(f"s{k}", n) for k, n in enumerate(sizes)])


def _streaming(sizes: list[int]) -> TaskStream:
    stream = _stream(sizes)
    for task in stream:
        task.train = task.train.to_iterable_dataset()
    return stream


def _context(stream: TaskStream, index: int, model=None, **fields) -> TaskContext:
    return TaskContext(index, stream.tasks[index], stream, model, output_dir=None, seed=RUN_SEED + index,
                       **fields)


def _ids(dataset) -> list[str]:
    return [row["image_id"] for row in dataset] if isinstance(dataset, IterableDataset) else list(dataset["image_id"])


def _pools(method, stream: TaskStream) -> list[list[str]]:
    """The image ids each task trains on, task after task."""
    return [_ids(method.train_dataset(_context(stream, k), stream.tasks[k].train)) for k in range(len(stream))]


def _prefix(task: Task, seed: int, count: int) -> set[str]:
    order = np.random.default_rng(seed).permutation(len(task.train))
    return {task.train[int(i)]["image_id"] for i in order[:count]}


# ----------------------------------------------------------------------------------------------------------------
# Buffer sizes (specs/ticclip.md §2.2 rules 3-4, §2.3), checked by hand
# ----------------------------------------------------------------------------------------------------------------
EXP_960 = {2: [960], 3: [480, 480], 4: [240, 240, 480], 5: [120, 120, 240, 480], 6: [60, 60, 120, 240, 480],
           7: [30, 30, 60, 120, 240, 480]}
EQUAL_960 = {2: [960], 3: [480] * 2, 4: [320] * 3, 5: [240] * 4, 6: [192] * 5, 7: [160] * 6}
# Floor rounding: B = 100 gives B/32 = 3.125 -> 3, B/3 = 33.3 -> 33, B/6 = 16.7 -> 16.
EXP_100 = {2: [100], 3: [50, 50], 4: [25, 25, 50], 5: [12, 12, 25, 50], 6: [6, 6, 12, 25, 50],
           7: [3, 3, 6, 12, 25, 50]}
EQUAL_100 = {2: [100], 3: [50] * 2, 4: [33] * 3, 5: [25] * 4, 6: [20] * 5, 7: [16] * 6}


@pytest.mark.parametrize("t", range(2, 8))
def test_buffer_sizes_by_hand(t):
    assert buffer_sizes([960] * 7, t, "exp") == EXP_960[t]
    assert buffer_sizes([960] * 7, t, "equal") == EQUAL_960[t]
    assert buffer_sizes([100] * 7, t, "exp") == EXP_100[t]
    assert buffer_sizes([100] * 7, t, "equal") == EQUAL_100[t]
    sizes = [50, 70, 90, 110, 130, 150, 170]
    assert buffer_sizes(sizes, t, "all") == sizes[: t - 1]
    assert buffer_sizes([960] * 7, t, "exp", capacity=960) == EXP_960[t]


def test_buffer_sizes_first_step_and_bad_input():
    assert buffer_sizes([10], 1, "exp") == []
    with pytest.raises(ValueError, match="t must be"):
        buffer_sizes([10, 10], 3, "exp")
    with pytest.raises(ValueError, match="rule"):
        buffer_sizes([10, 10], 2, "fifo")
    with pytest.raises(ValueError, match="capacity"):
        buffer_sizes([10, 10], 2, "exp", capacity="max")


def test_buffer_sizes_caps_and_no_redistribution():
    # Step 1 holds 30 < its share: it keeps 30 and the rest of B is not given to others (sum 780 < 1000).
    sizes = [30, 500, 1000, 1000]
    assert buffer_sizes(sizes, 2, "exp") == [30]  # B = 500, capped by |D_1|
    assert buffer_sizes(sizes, 3, "exp") == [30, 500]
    assert buffer_sizes(sizes, 4, "exp") == [30, 250, 500]
    assert buffer_sizes(sizes, 4, "equal") == [30, 333, 333]
    # A small step 2 caps every later share of step 1 too (n_j(t) <= n_j(t-1)): B_2 = 100 -> n_1 = 100 forever.
    assert buffer_sizes([1000, 100, 1000, 1000], 3, "exp") == [100, 100]
    assert buffer_sizes([1000, 100, 1000, 1000], 4, "exp") == [100, 100, 500]
    # capacity="mean": B_t = floor(mean |D_1..D_t|), e.g. B_2 = 300, B_3 = 400.
    assert buffer_sizes([400, 200, 600], 2, "exp", capacity="mean") == [300]
    assert buffer_sizes([400, 200, 600], 3, "exp", capacity="mean") == [200, 200]


def test_buffer_sizes_never_grow_and_respect_caps():
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 2000, size=7).tolist()
        for rule in ("exp", "equal", "all"):
            for capacity in ("current", "mean"):
                previous = None
                for t in range(2, 8):
                    now = buffer_sizes(sizes, t, rule, capacity)
                    assert all(0 <= n <= size for n, size in zip(now, sizes, strict=False))
                    if rule != "all":
                        bound = sizes[t - 1] if capacity == "current" else sum(sizes[:t]) // t
                        assert sum(now) <= bound
                    if previous is not None:
                        assert all(n <= p for n, p in zip(now, previous, strict=False))
                    previous = now


# ----------------------------------------------------------------------------------------------------------------
# The pool each strategy trains on
# ----------------------------------------------------------------------------------------------------------------
SIZES = [16, 12, 8, 8]


def test_pools_at_each_step():
    stream = _stream(SIZES)
    own = [set(task.train["image_id"]) for task in stream]
    for name in ("sequential", "finetune"):
        assert [set(p) for p in _pools(build_methods([name])[0], stream)] == own

    union = [set().union(*own[: k + 1]) for k in range(len(stream))]
    for name in ("cumulative_all", "restart", "oracle"):
        pools = _pools(build_methods([name])[0], stream)
        assert [set(p) for p in pools] == union and all(len(p) == len(set(p)) for p in pools)

    exp = build_methods(["cumulative_exp"])[0]
    pools = _pools(exp, stream)
    seeds = exp.pool.permutation_seeds
    # Step 4 (index 3): B = 8: step 1 and 2 keep 8/4 = 2 each, step 3 keeps 8/2 = 4 (floor, capped).
    assert exp.pool.history[3] == buffer_sizes(SIZES, 4, "exp") == [2, 2, 4]
    expected = own[3].union(*(_prefix(stream[j], seeds[j], n) for j, n in enumerate([2, 2, 4])))
    assert set(pools[3]) == expected and len(pools[3]) == 8 + 8
    # Nested prefixes: what step j keeps at index 3 was kept at index 2 (storage with deletion).
    for j in range(2):
        assert _prefix(stream[j], seeds[j], 2) <= set(pools[2])
    equal = build_methods(["cumulative_equal"])[0]
    pools = _pools(equal, stream)
    assert equal.pool.history[3] == [2, 2, 2]  # floor(8 / 3)
    assert len(pools[3]) == 8 + 6


def test_patching_holds_out_validation_rows():
    stream = _stream(SIZES)
    method = Patching({"validation_size": 3})
    pools = _pools(method, stream)
    for k, task in enumerate(stream):
        held = set(method.validation.image_ids[k])
        assert len(held) == 3 and held <= set(task.train["image_id"])
        assert set(pools[k]) == set(task.train["image_id"]) - held
        assert set(method.validation.task(_context(stream, k), k).eval["image_id"]) == held
    assert Patching({"validation_size": 0.25}).validation.count(16) == 4
    with pytest.raises(ValueError, match="no training rows"):
        Patching({"validation_size": 16}).train_dataset(_context(stream, 0), stream[0].train)


# ----------------------------------------------------------------------------------------------------------------
# Streaming pools (IterableDataset train splits)
# ----------------------------------------------------------------------------------------------------------------
def test_streaming_pool_mixes_in_proportion_to_sizes():
    stream = _streaming([200, 200, 200])
    method = CumulativeExp({"stream_sizes": [200, 200, 200], "shuffle_buffer_size": 50})
    for k in range(2):
        method.train_dataset(_context(stream, k), stream[k].train)
    pool = method.train_dataset(_context(stream, 2), stream[2].train)
    assert isinstance(pool, IterableDataset) and method.pool.history[2] == [100, 100]
    ids = _ids(pool)
    sources = Counter(image_id.split("/")[0] for image_id in ids)
    # Probabilities 200 : 100 : 100; all_exhausted stops once every source has been exhausted once.
    assert set(sources) == {"s0", "s1", "s2"}
    head = Counter(image_id.split("/")[0] for image_id in ids[:200])
    assert 0.4 < head["s2"] / 200 < 0.6 and 0.15 < head["s0"] / 200 < 0.35
    # Old steps contribute a fixed retained set of 100 rows each, the same at every epoch.
    retained = {s: {i for i in ids if i.startswith(s)} for s in ("s0", "s1")}
    assert all(len(rows) == 100 for rows in retained.values())
    pool.set_epoch(3)
    again = set(_ids(pool))
    assert {i for i in again if i.startswith("s0")} == retained["s0"]
    assert {i for i in again if i.startswith("s1")} == retained["s1"]


def test_retained_stream_is_nested_and_epoch_independent():
    stream = _streaming([50])
    small = retained_stream(stream[0].train, 10, seed=3, buffer_size=16)
    large = retained_stream(stream[0].train, 20, seed=3, buffer_size=16)
    assert _ids(small) == _ids(large)[:10]
    small.set_epoch(5)
    assert _ids(small) == _ids(large)[:10]


def test_streaming_without_sizes():
    stream = _streaming([30, 60])
    method = build_methods(["cumulative_all"])[0]  # unknown sizes: every stream whole, equal shares
    method.train_dataset(_context(stream, 0), stream[0].train)
    ids = _ids(method.train_dataset(_context(stream, 1), stream[1].train))
    assert set(ids) == {f"s0/train/{i}" for i in range(30)} | {f"s1/train/{i}" for i in range(60)}
    exp = build_methods(["cumulative_exp"])[0]
    exp.train_dataset(_context(stream, 0), stream[0].train)
    with pytest.raises(ValueError, match="stream_sizes"):
        exp.train_dataset(_context(stream, 1), stream[1].train)
    fixed = CumulativeExp({"capacity": 10})
    fixed.train_dataset(_context(stream, 0), stream[0].train)
    ids = _ids(fixed.train_dataset(_context(stream, 1), stream[1].train))
    assert sum(i.startswith("s0") for i in set(ids)) == 10


# ----------------------------------------------------------------------------------------------------------------
# State round trips: a resumed method builds the same pool
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cumulative_all", "cumulative_exp", "cumulative_equal", "restart", "oracle",
                                  "patching", "sequential"])
def test_state_round_trip_gives_the_same_pool(tmp_path, name):
    args = {"patching": {"validation_size": 2}}.get(name)
    stream = _stream(SIZES)
    method = build_methods([name], {name: args} if args else None)[0]
    for k in range(3):
        method.train_dataset(_context(stream, k), stream[k].train)
    if name == "patching":
        method.alphas, method.scores = {0: 1.0, 1: 0.4}, {0: [], 1: [(0.0, 1.0), (0.4, 2.0)]}
    save_method_states([method], tmp_path)
    resumed = build_methods([name], {name: args} if args else None)[0]
    load_method_states([resumed], tmp_path)
    assert resumed.state_dict() == method.state_dict()
    expected = _ids(method.train_dataset(_context(stream, 3), stream[3].train))
    assert _ids(resumed.train_dataset(_context(stream, 3), stream[3].train)) == expected
    if name == "cumulative_exp":
        state = resumed.state_dict()["pool"]
        assert state["buffer_sizes"] == {"1": [12], "2": [4, 4], "3": [2, 2, 4]}
        assert set(state["permutation_seeds"]) == {"0", "1", "2", "3"}
    if name == "patching":
        assert resumed.alphas == {0: 1.0, 1: 0.4} and resumed.validation.image_ids == method.validation.image_ids


# ----------------------------------------------------------------------------------------------------------------
# Restart and Oracle
# ----------------------------------------------------------------------------------------------------------------
def test_restart_starts_each_task_from_a_seeded_fresh_model():
    stream = _stream(SIZES)
    tokenizer = load_tokenizer()
    previous = tiny_clip(seed=0)
    method = Restart()
    first = _context(stream, 0, previous, tokenizer=tokenizer)
    method.on_task_start(first)
    assert first.model is previous  # task 0 keeps the given model
    later = _context(stream, 2, previous, tokenizer=tokenizer)
    method.on_task_start(later)
    new = later.model
    reference = tiny_clip(seed=RUN_SEED + 2)
    for (name, a), b, c in zip(new.state_dict().items(), reference.state_dict().values(),
                               previous.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        if a.is_floating_point() and a.numel() > 1 and "norm" not in name and "bias" not in name:
            assert not torch.equal(a, c), name
    assert new.config.text_config.eos_token_id == tokenizer.eos_token_id
    reinit = _context(stream, 0, previous)
    Restart({"reinit_first_task": True}).on_task_start(reinit)
    assert reinit.model is not previous
    state = torch.random.get_rng_state()
    fresh_model(previous, 123)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone


def test_oracle_needs_a_budget():
    stream = _stream(SIZES)
    with pytest.raises(ValueError, match="samples_per_task"):
        Oracle().training_overrides(_context(stream, 1, samples_per_task=None), {"num_train_epochs": 1})
    context = _context(stream, 2, samples_per_task=64, base_training={"warmup_steps": 3})
    overrides = Oracle().training_overrides(context, {"max_steps": 8, "warmup_steps": 0})
    assert overrides == {"max_steps": 24, "warmup_steps": 3}


# ----------------------------------------------------------------------------------------------------------------
# Every strategy on a real 3-task run: samples seen = budget, and the LR schedules (HF cosine with warmup)
# ----------------------------------------------------------------------------------------------------------------
BATCH, STEPS, WARMUP, PEAK = 8, 4, 2, 1e-3


class LRTrace(TrainerCallback):
    """The learning rate of every optimizer step, one list per task."""

    def __init__(self):
        self.tasks: list[list[float]] = []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        self.tasks.append([])

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001
        self.tasks[-1].append(optimizer.param_groups[0]["lr"])


def hf_cosine_lr(k: int, warmup: int, total: int) -> float:
    """transformers' `get_cosine_schedule_with_warmup` (num_cycles=0.5) at optimizer step k (0-based):
    k < W: eta * k / W (0 at the first step: OpenCLIP's cosine_lr uses (k+1)/W, specs/ticclip.md §2.4);
    else eta * 0.5 * (1 + cos(pi * (k - W) / (C - W)))."""
    if k < warmup:
        return PEAK * k / max(1, warmup)
    return PEAK * max(0.0, 0.5 * (1.0 + math.cos(math.pi * (k - warmup) / max(1, total - warmup))))


@pytest.fixture(scope="module")
def digits3():
    stream = build_stream("digits", max_train_per_task=24, max_eval_per_task=8)
    stream.tasks = stream.tasks[:3]
    return stream


@pytest.mark.parametrize("name", ["sequential", "cumulative_all", "cumulative_exp", "cumulative_equal", "restart",
                                  "oracle", "patching"])
def test_budget_and_lr_schedule_of_every_strategy(tmp_path, digits3, name):
    trace = LRTrace()
    args = ContinualArguments(
        output_dir=str(tmp_path), samples_per_task=BATCH * STEPS, warmup="first_task", progress=False,
        save_checkpoints=False, evaluation={"initial": False, "batch_size": 64},
        training={"per_device_train_batch_size": BATCH, "learning_rate": PEAK, "warmup_steps": WARMUP,
                  "lr_scheduler_type": "cosine", "logging_steps": 100},
    )
    options = {"patching": {"validation_size": 4, "alphas": [0.0, 0.5, 1.0]}}.get(name)
    methods = build_methods([name], {name: options} if options else None)
    learner = ContinualLearner(tiny_clip(seed=0), digits3, methods, load_image_processor(32), load_tokenizer(), args,
                               callbacks=[trace])
    learner.fit()
    from_scratch = name in ("restart", "oracle")
    for t, (record, lrs) in enumerate(zip(learner.compute, trace.tasks, strict=True)):
        steps = STEPS * (t + 1) if name == "oracle" else STEPS
        assert record.samples_seen == steps * BATCH and record.optimizer_steps == steps == len(lrs)
        warmup = WARMUP if t == 0 or from_scratch else 0
        np.testing.assert_allclose(lrs, [hf_cosine_lr(k, warmup, steps) for k in range(steps)], rtol=1e-12, atol=0)
        if warmup == 0:
            assert lrs[0] == PEAK  # warm-started steps restart at the same peak with no warmup
        else:
            assert lrs[0] == 0.0 and lrs[warmup] == PEAK
    if name == "patching":
        alphas = methods[0].alphas
        assert alphas[0] == 1.0 and set(alphas) == {0, 1, 2} and all(a in (0.0, 0.5, 1.0) for a in alphas.values())
        assert [a for a, _ in methods[0].scores[2]] == [0.0, 0.5, 1.0]


# ----------------------------------------------------------------------------------------------------------------
# Patching: interpolation and the alpha search
# ----------------------------------------------------------------------------------------------------------------
def test_interpolation_by_hand():
    old = {"w": torch.tensor([1.0, -2.0, 4.0]), "scale": torch.tensor(0.0), "ids": torch.tensor([0, 1]),
           "half": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}
    new = {"w": torch.tensor([3.0, 2.0, -6.0]), "scale": torch.tensor(10.0), "ids": torch.tensor([5, 6]),
           "half": torch.tensor([3.0, 5.0], dtype=torch.bfloat16)}
    mixed = interpolate_state_dicts(old, new, 0.3)
    # 0.7 * 1 + 0.3 * 3 = 1.6; 0.7 * -2 + 0.3 * 2 = -0.8; 0.7 * 4 + 0.3 * -6 = 1.0; 0.3 * 10 = 3.
    torch.testing.assert_close(mixed["w"], torch.tensor([1.6, -0.8, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(mixed["scale"], torch.tensor(3.0), rtol=0, atol=1e-6)
    assert torch.equal(mixed["ids"], new["ids"])  # integer buffers are copied
    assert mixed["half"].dtype == torch.bfloat16 and mixed["half"].tolist() == [1.6015625, 3.59375]
    for key in old:
        assert torch.equal(interpolate_state_dicts(old, new, 0.0)[key], old[key] if key != "ids" else new[key])
        assert torch.equal(interpolate_state_dicts(old, new, 1.0)[key], new[key])


def test_select_alpha_on_the_grid_with_ties_to_the_larger():
    assert DEFAULT_ALPHAS == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    alpha, scores = select_alpha(DEFAULT_ALPHAS, lambda a: -abs(a - 0.3))
    assert alpha == 0.3 and len(scores) == 11
    assert select_alpha(DEFAULT_ALPHAS, lambda a: 1.0)[0] == 1.0
    assert select_alpha([0.0, 0.5, 1.0], lambda a: 1.0 if a < 0.9 else 0.0)[0] == 0.5


@pytest.mark.parametrize("previous_only", [False, True])
def test_patching_after_training_picks_the_known_alpha(monkeypatch, previous_only):
    """The validation score peaks where the interpolated logit_scale is 0.3: the search must deploy alpha = 0.3, and
    the deployed weights are 0.7 * theta^p_{t-1} + 0.3 * theta^ft_t."""
    stream = _stream([12, 12])
    evaluated: list[str] = []

    def fake_evaluate(model, task, *args, **kwargs):  # noqa: ANN001
        evaluated.append(task.name)
        score = -abs(float(model.logit_scale.detach()) - 0.3)
        return {"i2t_R@1": score, "t2i_R@1": score}

    monkeypatch.setattr(patching_module, "evaluate_task", fake_evaluate)
    method = Patching({"validation_size": 2, "previous_only": previous_only})
    model = tiny_clip(seed=0)
    with torch.no_grad():
        model.logit_scale.fill_(0.0)
    context = _context(stream, 0, model)
    method.train_dataset(context, stream[0].train)
    assert method.after_training(context) is None and method.alphas == {0: 1.0}
    previous = {k: v.clone() for k, v in model.state_dict().items()}
    context = _context(stream, 1, model)
    method.on_task_start(context)
    method.train_dataset(context, stream[1].train)
    finetuned = tiny_clip(seed=1)
    with torch.no_grad():
        finetuned.logit_scale.fill_(1.0)
    model.load_state_dict(finetuned.state_dict())  # "training"
    assert method.after_training(context) is None  # patched in place: context.model is the deployed model
    deployed = context.model
    assert deployed is model and method.alphas[1] == 0.3
    assert evaluated == 11 * (["s0/validation"] if previous_only else ["s0/validation", "s1/validation"])
    for name, tensor in deployed.state_dict().items():
        expected = 0.7 * previous[name] + 0.3 * finetuned.state_dict()[name] if tensor.is_floating_point() else tensor
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-6)
    assert method.state_dict()["alphas"] == {"0": 1.0, "1": 0.3}


def test_registered_names():
    for name in ("sequential", "cumulative_all", "cumulative_exp", "cumulative_equal", "restart", "oracle",
                 "patching"):
        assert get_method_class(name).name == name


def test_a_task_smaller_than_one_batch_under_a_budget_is_an_error(tmp_path):
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
    from hf_ccl.methods import build_methods
    from hf_ccl.testing import tiny_clip

    stream = build_stream("digits", max_train_per_task=12, max_eval_per_task=8)
    stream.tasks = stream.tasks[:2]
    learner = ContinualLearner(
        tiny_clip(0), stream, build_methods(["sequential"]), load_image_processor(32), load_tokenizer(),
        ContinualArguments(output_dir=str(tmp_path), progress=False, samples_per_task=32,
                           training={"per_device_train_batch_size": 16}),
    )
    with pytest.raises(ValueError, match="fewer than one global batch"):
        learner.fit()
