"""DER and DER++ on learner heads (pair tasks, CMCL's setting; specs/cmcl.md §4, App. A.4): `hf_ccl.methods.replay`
on cached pair features, its hooks driven by hand on a real `ContinualCLIPModel` with heads, and through the one loop
(`ContinualLearner` with `learner_heads` + `derpp`). Ported from the pairs package's DER++ tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from hf_ccl.callbacks import TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner, check_pair_stream
from hf_ccl.data import Task, TaskStream, load_image_processor
from hf_ccl.heads import LearnerHeads
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.replay import DarkExperienceReplay, DarkExperienceReplayPlusPlus, PairMemory
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.pair_features import FEATURE_COLUMNS, PairFeatureCollator
from hf_ccl.testing import StopAfterTask, TrainingLogRecorder, tiny_clip
from hf_ccl.validation import ConfigError

D, N, TEMPERATURE = 8, 48, 0.2
PAIRS = [("a", "b"), ("a", "c"), ("c", "b")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (up to 30x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- a toy stream of cached features, and the hooks by hand ---------------------------------------------------------
def toy_stream(pairs: list[tuple[str, str]], seed: int = 0) -> TaskStream:
    """Encoded pair tasks whose b side is a random rotation of the a side plus noise, unit-norm rows: identity heads
    align them badly, so every task has to move its heads."""
    generator = torch.Generator().manual_seed(seed)
    tasks = []
    for index, (modality_a, modality_b) in enumerate(pairs):
        xa = F.normalize(torch.randn(N, D, generator=generator), dim=-1)
        rotation, _ = torch.linalg.qr(torch.randn(D, D, generator=generator))
        xb = F.normalize(xa @ rotation.T + 0.1 * torch.randn(N, D, generator=generator), dim=-1)
        split = Dataset.from_dict({"features_a": xa.numpy(), "features_b": xb.numpy()}).with_format("torch")
        tasks.append(Task(f"task{index}", split, split, kind="pair", modalities=(modality_a, modality_b),
                          columns=FEATURE_COLUMNS))
    return TaskStream("toy", tasks)


def features(stream: TaskStream, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = stream[index].train[:]
    return rows["features_a"], rows["features_b"]


def model_with_heads(stream: TaskStream, similarity: str = "dot", dtype: torch.dtype = torch.float32):
    model = tiny_clip(seed=0)
    model.requires_grad_(False)
    model.learner_heads = LearnerHeads(D, stream.modalities, temperature=TEMPERATURE, similarity=similarity,
                                       fold=None).to(dtype)
    return model


def make_context(stream: TaskStream, index: int, model: torch.nn.Module) -> TaskContext:
    context = TaskContext(index, stream[index], stream, model, seed=index)
    context.collator, context.train_dataset = PairFeatureCollator(stream[index].modalities), stream[index].train
    context.per_device_batch_size = 16
    return context


def pair_batch(stream: TaskStream, index: int, rows: slice | list[int], dtype: torch.dtype = torch.float32,
               cached: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """A batch of task `index` as `PairFeatureCollator` makes it (from the `cached` features when given)."""
    xa, xb = cached or features(stream, index)
    modality_a, modality_b = stream[index].modalities
    return {"features_a": xa[rows].to(dtype), "features_b": xb[rows].to(dtype), "modality_a": modality_a,
            "modality_b": modality_b}


def step_terms(method: DarkExperienceReplay, model: torch.nn.Module, context: TaskContext) -> dict[str, torch.Tensor]:
    """The method's terms for a batch of the context's task (its first 4 pairs), as the trainer asks for them."""
    batch = pair_batch(context.stream, context.task_index, slice(0, 4))
    return method.loss_terms(model, batch, model(**batch, return_loss=True), context)


def perturb(heads: LearnerHeads, modalities: list[str], seed: int = 1, scale: float = 0.1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for modality in modalities:
            weight = heads.heads[modality].weight
            weight.add_(scale * torch.randn(weight.shape, generator=generator).to(weight.dtype))


def scores(z_a: torch.Tensor, z_b: torch.Tensor, similarity: str) -> torch.Tensor:
    """S_ij = s(z^a_i, z^b_j) / τ by hand."""
    if similarity == "cosine":
        z_a, z_b = z_a / z_a.norm(dim=-1, keepdim=True), z_b / z_b.norm(dim=-1, keepdim=True)
    return z_a @ z_b.T / TEMPERATURE


def round_trip(method: DarkExperienceReplay, tmp_path) -> DarkExperienceReplay:
    """Save through the method-state files (JSON + safetensors) and load into a fresh instance."""
    save_method_states([method], tmp_path)
    fresh = type(method)(method.config)
    load_method_states([fresh], tmp_path)
    return fresh


# ----- the terms and the state, by hand ------------------------------------------------------------------------------
@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_derpp_buffer_terms_and_state(tmp_path, similarity):
    """Buffer of feature rows with the outputs recorded at insertion; the terms by hand (Buzzega et al. Eq. 4 and 6
    on the pair scores, size-weighted over task groups); the state round trip gives the same terms and updates."""
    stream = toy_stream([("a", "b"), ("a", "c"), ("b", "c")])
    model = model_with_heads(stream, similarity)
    heads = model.learner_heads
    method = DarkExperienceReplayPlusPlus({"buffer_size": 20, "replay_batch_size": 64, "alpha": 0.3, "beta": 0.2})
    context = make_context(stream, 0, model)
    terms = step_terms(method, model, context)
    assert set(terms) == {"mse", "replay_contrastive"} and all(float(v) == 0.0 for v in terms.values())
    assert set(step_terms(DarkExperienceReplay(), model, context)) == {"mse"}

    perturb(heads, ["a", "b"])
    method.on_task_end(context)
    assert len(method.buffer) == 20 and method.buffer.num_seen == N and method.pairs.modalities == {0: ("a", "b")}
    xa, xb = features(stream, 0)
    stored = method.pairs.tensors
    for slot, (task, row) in enumerate(method.buffer.refs):  # the features and outputs of the stored rows
        assert task == 0
        torch.testing.assert_close(stored["features_a"][slot], xa[row])
        torch.testing.assert_close(stored["z_b"][slot], heads.head_output("b", xb[row]).detach())
    # Right after storing, current scores = stored scores: the MSE is 0 and the CE is the plain pair loss.
    terms = step_terms(method, model, make_context(stream, 1, model))
    assert abs(float(terms["mse"].detach())) < 1e-10
    expected = 0.2 * heads("a", "b", stored["features_a"], stored["features_b"]).loss
    torch.testing.assert_close(terms["replay_contrastive"], expected)

    perturb(heads, ["a", "c"], seed=3)
    method.on_task_end(make_context(stream, 1, model))
    assert len(method.buffer) == 20 and method.buffer.num_seen == 2 * N
    assert set(method.buffer.task_counts()) == {0, 1}
    # Task 2 (b, c), heads moved: both terms by hand, per task group, size-weighted; the whole buffer is drawn.
    perturb(heads, ["a", "b", "c"], seed=4)
    heads.train_only(["b", "c"])
    context = make_context(stream, 2, model)
    method.on_task_start(context)
    terms = step_terms(method, model, context)
    tasks = torch.as_tensor(method.buffer.slot_tasks())
    mse = ce = 0.0
    for task, (modality_a, modality_b) in enumerate([("a", "b"), ("a", "c")]):
        rows = tasks == task
        x = {name: stored[name][rows] for name in PairMemory.FIELDS}
        current = scores(heads.head_output(modality_a, x["features_a"]), heads.head_output(modality_b, x["features_b"]),
                         similarity)
        weight = int(rows.sum()) / 20
        mse = mse + weight * (current - scores(x["z_a"], x["z_b"], similarity)).pow(2).mean()
        ce = ce + weight * F.cross_entropy(current, torch.arange(len(current)))
    torch.testing.assert_close(terms["mse"], 0.3 * mse)
    torch.testing.assert_close(terms["replay_contrastive"], 0.2 * ce)
    assert float(terms["mse"].detach()) > 0
    (terms["mse"] + terms["replay_contrastive"]).backward()
    assert heads.heads["a"].weight.grad is None and heads.heads["b"].weight.grad is not None

    # State: a resumed method gives the same terms (the same draw), then the same reservoir update.
    resumed = round_trip(method, tmp_path)
    assert resumed.pairs.modalities == method.pairs.modalities and resumed.pairs.draws == method.pairs.draws == 1
    for copy in (method, resumed):
        copy.config.replay_batch_size = 5  # a real draw (5 of 20 slots)
    torch.testing.assert_close(step_terms(resumed, model, context), step_terms(method, model, context))
    method.on_task_end(context)
    resumed.on_task_end(context)
    assert method.buffer.refs == resumed.buffer.refs
    for name in PairMemory.FIELDS:
        assert torch.equal(method.pairs.tensors[name], resumed.pairs.tensors[name])
    # Draws differ from step to step, and a task starts its draws afresh.
    method.on_task_start(context)
    first, second = ([(t, s.tolist()) for t, s in method.draw(context)] for _ in range(2))
    assert first != second
    method.on_task_start(context)
    assert [(t, s.tolist()) for t, s in method.draw(context)] == first


def test_unset_options_take_the_settings_defaults_and_pairs_are_never_mixed_in():
    """None means the setting's value: CLIP tasks 8,000 / α 1 / β 0.5 (unchanged), pair tasks 256 / 0.1 / 0.1
    (CMCL App. E, §4); the budget is fixed at the first update. On a pair task the training data stays the task's."""
    derpp = DarkExperienceReplayPlusPlus()
    assert (derpp.capacity(False), derpp.option("alpha", False), derpp.option("beta", False)) == (8_000, 1.0, 0.5)
    assert (derpp.capacity(True), derpp.option("alpha", True), derpp.option("beta", True)) == (256, 0.1, 0.1)
    assert derpp.buffer.capacity == 8_000 and derpp.term_weights(pair=True) == {"mse": 0.1, "replay_contrastive": 0.1}
    explicit = DarkExperienceReplayPlusPlus({"buffer_size": 5, "alpha": 0.3, "beta": 0.0})
    assert explicit.term_weights(pair=True) == explicit.term_weights(pair=False) == {"mse": 0.3,
                                                                                      "replay_contrastive": 0.0}
    stream = toy_stream(PAIRS)
    model = model_with_heads(stream)
    der = DarkExperienceReplay()
    der.on_task_end(make_context(stream, 0, model))
    assert der.buffer.capacity == 256 and len(der.buffer) == N and len(der.pairs) == N
    with pytest.raises(ValueError, match="fixed once"):
        der.buffer.set_capacity(3)
    context = make_context(stream, 1, model)
    assert der.train_dataset(context, stream[1].train) is stream[1].train
    assert der.state_dict()["captions"].numel() == 0 and "image_targets" not in der.state_dict()


def test_pair_streams_take_der_and_derpp_after_learner_heads_but_not_er(tmp_path):
    stream = toy_stream(PAIRS)
    args = ContinualArguments(output_dir=str(tmp_path), progress=False)
    for name in ("der", "derpp"):
        check_pair_stream(stream, build_methods(["learner_heads", name]), args)
        with pytest.raises(ConfigError, match=rf"Put '{name}' after 'learner_heads'"):
            build_methods([name, "learner_heads"])
    with pytest.raises(ConfigError, match=r"\['er'\] do not train pair tasks"):
        check_pair_stream(stream, build_methods(["learner_heads", "er"]), args)


def test_state_refuses_slots_without_their_outputs(tmp_path):
    stream = toy_stream(PAIRS)
    der = DarkExperienceReplay({"buffer_size": 10})
    der.on_task_end(make_context(stream, 0, model_with_heads(stream)))
    state = der.state_dict()
    broken = {**state, "pairs": {**state["pairs"], "modalities": {}}}
    with pytest.raises(ValueError, match=r"task\(s\) \[0\] without a modality pair"):
        DarkExperienceReplay({"buffer_size": 10}).load_state_dict(broken)
    broken = {**state, "pairs": {name: value[:5] if isinstance(value, torch.Tensor) else value
                                 for name, value in state["pairs"].items()}}
    with pytest.raises(ValueError, match="10 buffer slots but 0 captions, 0 stored embeddings and 5 stored pairs"):
        DarkExperienceReplay({"buffer_size": 10}).load_state_dict(broken)


# ----- training by hand: forgetting and dtype ------------------------------------------------------------------------
def train_stream(
    method: DarkExperienceReplay | None, stream: TaskStream, steps: int = 40, lr: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.nn.Module, list[float]]:
    """The loop by hand: loss = pair loss + the method's terms, plain SGD on the current pair's heads, the method's
    task start and end around each task. The cached features stay float32; batches are cast to the heads' dtype.
    Returns the model and the loss on task 1 after each task."""
    model = model_with_heads(stream, dtype=dtype)
    heads = model.learner_heads
    first_task = []
    for index, task in enumerate(stream):
        context = make_context(stream, index, model)
        if method is not None:
            method.on_task_start(context)
        heads.train_only(task.modalities)
        optimizer = torch.optim.SGD([p for p in heads.parameters() if p.requires_grad], lr=lr)
        generator = torch.Generator().manual_seed(100 + index)
        cached = features(stream, index)
        for _ in range(steps):
            batch = pair_batch(stream, index, torch.randperm(N, generator=generator)[:16].tolist(), dtype, cached)
            outputs = model(**batch, return_loss=True)
            terms = {} if method is None else method.loss_terms(model, batch, outputs, context)
            optimizer.zero_grad()
            (outputs.loss + sum(terms.values())).backward()
            assert all(p.grad.dtype == dtype for p in heads.parameters() if p.requires_grad)
            optimizer.step()
        heads.requires_grad_(False)
        if method is not None:
            method.on_task_end(context)
        with torch.no_grad():
            first_task.append(float(model(**pair_batch(stream, 0, slice(None), dtype), return_loss=True).loss))
    return model, first_task


SEEDS = range(5)


def forgetting(losses: list[float]) -> float:
    """How much the loss on task 1 rose from right after it to the end of the stream."""
    return losses[-1] - losses[0]


@pytest.fixture(scope="module")
def finetune_forgetting() -> list[float]:
    return [forgetting(train_stream(None, toy_stream(PAIRS, seed))[1]) for seed in SEEDS]


@pytest.mark.parametrize("method_class", [DarkExperienceReplay, DarkExperienceReplayPlusPlus], ids=["der", "derpp"])
def test_replay_forgets_task_one_less_than_finetune(method_class, finetune_forgetting):
    """Three pairs sharing heads (a-b, a-c, c-b) on five toy streams: with CMCL's α and β (the pair defaults) and a
    32-pair buffer, task 1 is forgotten less than by plain fine-tuning on every stream (0.3 to 0.8 of it), and in all
    by < 3/4 (0.57 here). Forgetting is the rise of task 1's loss from right after it to the end."""
    replay = []
    for seed in SEEDS:
        method = method_class({"buffer_size": 32, "replay_batch_size": 16})
        replay.append(forgetting(train_stream(method, toy_stream(PAIRS, seed))[1]))
    assert all(mine < theirs for mine, theirs in zip(replay, finetune_forgetting, strict=True)), replay
    assert sum(replay) < 0.75 * sum(finetune_forgetting), (replay, finetune_forgetting)


@pytest.mark.parametrize("method_class", [DarkExperienceReplay, DarkExperienceReplayPlusPlus], ids=["der", "derpp"])
def test_replay_runs_in_the_heads_dtype(method_class):
    """float64 heads on float32 cached features: replay follows the heads' dtype (gradients checked in
    `train_stream`), the stored rows stay float32."""
    stream = toy_stream(PAIRS)
    method = method_class({"buffer_size": 32, "replay_batch_size": 16})
    model, _ = train_stream(method, stream, steps=3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.learner_heads.parameters())
    assert all(t.dtype == torch.float32 for t in method.pairs.tensors.values())
    context = make_context(stream, 2, model)
    batch = pair_batch(stream, 2, slice(0, 4), torch.float64)
    terms = method.loss_terms(model, batch, model(**batch, return_loss=True), context)
    assert all(bool(torch.isfinite(v)) and float(v) > 0 for v in terms.values())


# ----- through the loop ------------------------------------------------------------------------------------------
TRAINING = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "logging_steps": 1}
LOOP_METHODS = ["learner_heads", "derpp"]
LOOP_OPTIONS = {"learner_heads": {"similarity": "cosine"}, "derpp": {"buffer_size": 48, "replay_batch_size": 16}}


class TrainingSizes(TaskCallback):
    """How many rows each task trained on."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 (TaskCallback protocol)
        self.sizes.append(len(kwargs["train_dataset"]))


def _learner(stream: TaskStream, folder, tokenizer, **args) -> ContinualLearner:
    arguments = ContinualArguments(output_dir=str(folder), training=dict(TRAINING), progress=False, **args)
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods(LOOP_METHODS, LOOP_OPTIONS),
                            load_image_processor(32), tokenizer, arguments)


@pytest.fixture(scope="module")
def full_run(pair_stream, clip_tokenizer, tmp_path_factory) -> tuple[ContinualLearner, TrainingLogRecorder, list[int]]:
    """The three flickr pair tasks straight through, with the per-step logs and each task's training rows."""
    learner = _learner(pair_stream, tmp_path_factory.mktemp("derpp-pairs") / "full", clip_tokenizer)
    recorder, sizes = TrainingLogRecorder(), TrainingSizes()
    learner.task_callbacks.add([recorder, sizes])
    learner.fit()
    return learner, recorder, sizes.sizes


def test_loop_derpp_on_pairs_replays_by_task_and_saves_its_state(full_run):
    """Through `ContinualLearner`: the tasks train on their own pairs only, the replay terms are 0 on the first task
    and engage after it, the buffer holds every task's pairs with their modality pair, and the state the loop wrote
    reads back."""
    learner, recorder, sizes = full_run
    assert sizes == [64, 64, 64]
    first, later = recorder.step_logs(0), [log for task in (1, 2) for log in recorder.step_logs(task)]
    assert all(log["loss/derpp/mse"] == 0.0 and log["loss/derpp/replay_contrastive"] == 0.0 for log in first)
    assert all(log["loss/derpp/replay_contrastive"] > 0.0 for log in later)
    assert max(log["loss/derpp/mse"] for log in later) > 0.0
    derpp = learner.methods[1]
    assert len(derpp.buffer) == 48 and derpp.buffer.num_seen == 192 and set(derpp.buffer.task_counts()) == {0, 1, 2}
    assert derpp.pairs.modalities == {0: ("image", "en"), 1: ("en", "de"), 2: ("image", "de")}
    restored = build_methods(LOOP_METHODS, LOOP_OPTIONS)
    load_method_states(restored, learner.output_dir / "task-2")
    assert restored[1].buffer.refs == derpp.buffer.refs and restored[1].pairs.modalities == derpp.pairs.modalities
    for name in PairMemory.FIELDS:
        assert torch.equal(restored[1].pairs.tensors[name], derpp.pairs.tensors[name]), name


def test_loop_derpp_on_pairs_resumes_exactly_after_a_task(full_run, pair_stream, clip_tokenizer, tmp_path):
    """A run stopped after task 1 (a task callback sets `should_stop`) and resumed from its checkpoint ends with the
    uninterrupted run's heads, buffer, stored pairs and results."""
    full, derpp = full_run[0], full_run[0].methods[1]
    cut = _learner(pair_stream, tmp_path, clip_tokenizer)
    cut.task_callbacks.add([StopAfterTask(1)])
    cut.fit()
    assert len(cut.results.rows) == 2
    resumed = _learner(pair_stream, tmp_path, clip_tokenizer, resume_from_checkpoint=True)
    resumed.fit()
    for name, value in full.model.learner_heads.state_dict().items():
        assert torch.allclose(value, resumed.model.learner_heads.state_dict()[name], atol=1e-6), name
    again = resumed.methods[1]
    assert again.buffer.refs == derpp.buffer.refs and again.pairs.draws == derpp.pairs.draws == 4
    for name in PairMemory.FIELDS:
        torch.testing.assert_close(again.pairs.tensors[name], derpp.pairs.tensors[name], rtol=0, atol=1e-6)
    assert resumed.results.rows[-1].to_dict() == full.results.rows[-1].to_dict()
