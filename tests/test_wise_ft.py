"""WiSE-FT (`wise_ft`) and ZSCL's weight ensemble (`weight_ensemble`, `WeightEnsemble`): the interpolation and the
running mean by hand, then on real 2-task runs of a tiny CLIP on `digits` (alpha = 0 / 1, the reference and the
continuation variants, the mean of the recorded snapshots), an exact mid-task resume, and the options and method
combinations refused. Exact resume after a task is `tests/test_method_registry.py`'s every-method matrix."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from hf_ccl.callbacks import TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_tokenizer
from hf_ccl.families import default_image_processor
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.state import load_method_states, save_method_states
from hf_ccl.methods.weight_ensemble import WeightEnsemble, interpolate_state_dicts
from hf_ccl.methods.wise_ft import WiseFT
from hf_ccl.testing import tiny_clip
from hf_ccl.validation import ConfigError

SEED = 1


# ----------------------------------------------------------------------------------------------------------------
# By hand, on a model of two parameters
# ----------------------------------------------------------------------------------------------------------------
class TwoParameters(nn.Module):
    def __init__(self, w: float = 0.0, b: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))
        self.b = nn.Parameter(torch.tensor(b))

    def set(self, w: float, b: float) -> TwoParameters:
        with torch.no_grad():
            self.w.fill_(w)
            self.b.fill_(b)
        return self

    def values(self) -> tuple[float, float]:
        return float(self.w.detach()), float(self.b.detach())


def _context(index: int, model: nn.Module) -> TaskContext:
    return TaskContext(index, types.SimpleNamespace(name=f"t{index}"), None, model)  # type: ignore[arg-type]


def test_interpolation_by_hand():
    old, new = {"w": torch.tensor(1.0), "b": torch.tensor(-2.0)}, {"w": torch.tensor(3.0), "b": torch.tensor(2.0)}
    mixed = interpolate_state_dicts(old, new, 0.8)
    # 0.2 * 1 + 0.8 * 3 = 2.6; 0.2 * -2 + 0.8 * 2 = 1.2
    assert mixed["w"].item() == pytest.approx(2.6, abs=1e-6) and mixed["b"].item() == pytest.approx(1.2, abs=1e-6)
    assert all(torch.equal(interpolate_state_dicts(old, new, 0.0)[k], old[k]) for k in old)
    assert all(torch.equal(interpolate_state_dicts(old, new, 1.0)[k], new[k]) for k in old)


@pytest.mark.parametrize(("reference", "continue_from", "task_1_start", "deployed_1"), [
    # alpha = 0.25; task 0: reference (2, -1), fine-tuned (6, 3), deployed 0.75 * (2, -1) + 0.25 * (6, 3) = (3, 0).
    # Task 1 trains from its start to start + (4, -8), then deploys 0.75 * reference + 0.25 * fine-tuned.
    ("initial", "finetuned", (6.0, 3.0), (4.0, -2.0)),        # 0.75 (2, -1) + 0.25 (10, -5)
    ("previous", "finetuned", (6.0, 3.0), (7.0, 1.0)),        # 0.75 (6, 3) + 0.25 (10, -5)
    ("initial", "interpolated", (3.0, 0.0), (3.25, -2.75)),   # 0.75 (2, -1) + 0.25 (7, -8)
    ("previous", "interpolated", (3.0, 0.0), (4.0, -2.0)),    # 0.75 (3, 0) + 0.25 (7, -8)
])
def test_wise_ft_hooks_by_hand(reference, continue_from, task_1_start, deployed_1):
    method = WiseFT({"alpha": 0.25, "reference": reference, "continue_from": continue_from})
    model = TwoParameters(2.0, -1.0)
    method.on_task_start(_context(0, model))
    model.set(6.0, 3.0)  # "training"
    method.after_training(_context(0, model))
    assert model.values() == (3.0, 0.0)  # deployed in place
    method.on_task_start(_context(1, model))
    assert model.values() == task_1_start
    start = model.values()
    model.set(start[0] + 4.0, start[1] - 8.0)
    method.after_training(_context(1, model))
    assert model.values() == deployed_1
    state = method.state_dict()
    assert (state["reference"] is None) == (reference == "previous")
    assert (state["finetuned"] is None) == (continue_from == "interpolated")


def test_wise_ft_refuses_a_model_of_other_shapes_before_training():
    """A reference that cannot be interpolated with the model (a grown vocabulary) fails at task start."""
    method = WiseFT()
    method.on_task_start(_context(0, nn.Linear(2, 3)))
    method.after_training(_context(0, nn.Linear(2, 3)))
    with pytest.raises(ValueError, match="shape"):
        method.on_task_start(_context(1, nn.Linear(2, 4)))


def test_weight_ensemble_by_hand(tmp_path):
    """θ_0 = 0; step s sets w = 3s. Every 2 steps ("paper": steps 2, 4) the mean takes the weights after the step,
    after post-step edits (a clamp to 10 at step 4): (0 + 6 + 10) / 3. A state saved with step 4 due resumes it."""
    assert [s for s in range(1, 8) if WeightEnsemble(2, "paper").due(s)] == [2, 4, 6]
    assert [s for s in range(1, 8) if WeightEnsemble(2, "code").due(s)] == [1, 3, 5, 7]
    assert [s for s in range(1, 4) if WeightEnsemble(1).due(s)] == [1, 2, 3]
    model = TwoParameters(0.0, 1.0)
    ensemble = WeightEnsemble(every=2)
    ensemble.reset()
    for step in range(1, 5):
        ensemble.flush(model)  # pre_optimizer_step: θ_0 at the first step, then the due step's weights
        model.set(3.0 * step, 1.0)  # optimizer step `step`
        ensemble.update(model, step)  # post_optimizer_step
        if step == 4:
            model.set(10.0, 1.0)  # an edit after the methods' post-step hooks (the logit-scale clamp)
    assert ensemble.pending == 4 and ensemble.steps == [2] and ensemble.count == 2
    save_method_states([types.SimpleNamespace(name="we", config=types.SimpleNamespace(to_dict=dict),
                                              state_dict=ensemble.state_dict)], tmp_path)  # mid-task checkpoint
    resumed = WeightEnsemble(every=2)
    load_method_states([types.SimpleNamespace(name="we", load_state_dict=resumed.load_state_dict)], tmp_path)
    for one in (ensemble, resumed):
        one.apply(model)
        assert model.w.item() == pytest.approx(16.0 / 3.0, abs=1e-6) and model.b.item() == 1.0  # b never moved
        assert one.steps == [2, 4] and one.count == 3
        model.set(10.0, 1.0)
    with pytest.raises(RuntimeError, match="flush"):  # a due step never flushed is an error, not a wrong mean
        ensemble.reset(model)
        ensemble.update(model, 2)
        ensemble.update(model, 3)


# ----------------------------------------------------------------------------------------------------------------
# Real 2-task runs
# ----------------------------------------------------------------------------------------------------------------
def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_floating_point(v)}


class Weights(TrainerCallback):
    """Per task: the weights it trains from, after each optimizer step (after the trainer's post-step clamp), and
    when it finished training (before the methods' `after_training`)."""

    def __init__(self) -> None:
        self.start: list[dict[str, torch.Tensor]] = []
        self.steps: list[dict[int, dict[str, torch.Tensor]]] = []
        self.trained: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001 (Trainer callback protocol)
        self.start.append(_weights(model))
        self.steps.append({})

    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        self.steps[-1][state.global_step] = _weights(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001
        self.trained.append(_weights(model))


class Deployed(TaskCallback):
    """Per task: the deployed model (after the methods' `after_training`)."""

    def __init__(self) -> None:
        self.models: list[dict[str, torch.Tensor]] = []

    def on_task_trained(self, args, state, control, context=None, **kwargs):  # noqa: ANN001
        self.models.append(_weights(context.model))


def fit(output_dir, methods, method_args=None, *, steps=2, batch=16, training=None, weights=None, deployed=None,
        **arguments):
    """Two digits tasks of `steps` optimizer steps of `batch` on a tiny seeded CLIP."""
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=8)
    stream.tasks = stream.tasks[:2]
    model = tiny_clip(seed=SEED)
    args = ContinualArguments(
        output_dir=str(output_dir), samples_per_task=steps * batch, progress=False, seed=SEED,
        training={"per_device_train_batch_size": batch, "learning_rate": 1e-3, "logging_steps": 100,
                  **(training or {})},
        **{"evaluation": {"initial": False}, "save_checkpoints": False, **arguments},
    )
    learner = ContinualLearner(
        model, stream, build_methods(methods, method_args), default_image_processor(model), load_tokenizer(), args,
        callbacks=[weights] if weights else None, task_callbacks=[deployed] if deployed else None,
    )
    learner.fit()
    return learner


def assert_equal(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    assert one.keys() == other.keys()
    for name in one:
        assert torch.equal(one[name], other[name]), name


def assert_close(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    assert one.keys() == other.keys()
    for name in one:
        torch.testing.assert_close(one[name], other[name], rtol=1e-6, atol=1e-6, msg=name)


def assert_state_close(one, other) -> None:
    """Two method states (nested dicts of tensors and plain values) agree."""
    if isinstance(other, dict):
        assert isinstance(one, dict) and one.keys() == other.keys()
        for key in other:
            assert_state_close(one[key], other[key])
    elif isinstance(other, torch.Tensor):
        torch.testing.assert_close(one, other, rtol=1e-6, atol=1e-6)
    else:
        assert one == other


def mix(reference: dict[str, torch.Tensor], finetuned: dict[str, torch.Tensor], alpha: float):
    return {k: (1 - alpha) * reference[k] + alpha * finetuned[k] for k in reference}


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    """Plain fine-tuning: the weights every task trains to."""
    weights, deployed = Weights(), Deployed()
    fit(tmp_path_factory.mktemp("finetune"), ["finetune"], weights=weights, deployed=deployed)
    return weights, deployed


@pytest.mark.parametrize("continue_from", ["finetuned", "interpolated"])
def test_alpha_1_deploys_the_finetuned_model(tmp_path, finetune_run, continue_from):
    weights, deployed = Weights(), Deployed()
    fit(tmp_path, ["wise_ft"], {"wise_ft": {"alpha": 1.0, "continue_from": continue_from}}, weights=weights,
        deployed=deployed)
    for task in range(2):
        assert_equal(deployed.models[task], finetune_run[1].models[task])
        assert_equal(weights.trained[task], finetune_run[0].trained[task])


@pytest.mark.parametrize("continue_from", ["finetuned", "interpolated"])
def test_alpha_0_deploys_the_reference(tmp_path, finetune_run, continue_from):
    """alpha = 0 deploys the initial model after every task. The next task trains from the fine-tuned weights (so
    the fine-tuning is plain fine-tuning's) or from the deployed model, i.e. the initial one."""
    weights, deployed = Weights(), Deployed()
    fit(tmp_path, ["wise_ft"], {"wise_ft": {"alpha": 0.0, "continue_from": continue_from}}, weights=weights,
        deployed=deployed)
    initial = _weights(tiny_clip(seed=SEED))
    assert_equal(weights.start[0], initial)
    for task in range(2):
        assert_equal(deployed.models[task], initial)
    assert not torch.equal(weights.trained[0]["text_projection.weight"], initial["text_projection.weight"])  # trained
    if continue_from == "finetuned":
        assert_equal(weights.start[1], finetune_run[0].trained[0])
        assert_equal(weights.trained[1], finetune_run[0].trained[1])
    else:
        assert_equal(weights.start[1], initial)


@pytest.mark.parametrize("continue_from", ["finetuned", "interpolated"])
def test_reference_initial_and_previous(tmp_path, continue_from):
    """Deployed = 0.5 * reference + 0.5 * fine-tuned, the reference being the initial model or the model the task
    started from: the same at task 0, different at task 1. Task 1 starts from task 0's fine-tuned or deployed model."""
    runs = {}
    for reference in ("initial", "previous"):
        weights, deployed = Weights(), Deployed()
        fit(tmp_path / reference, ["wise_ft"],
            {"wise_ft": {"alpha": 0.5, "reference": reference, "continue_from": continue_from}},
            weights=weights, deployed=deployed)
        runs[reference] = weights, deployed
        for task in range(2):
            expected = weights.start[0] if reference == "initial" else weights.start[task]
            assert_close(deployed.models[task], mix(expected, weights.trained[task], 0.5))
        assert_equal(weights.start[1], weights.trained[0] if continue_from == "finetuned" else deployed.models[0])
    (initial, initial_deployed), (previous, previous_deployed) = runs["initial"], runs["previous"]
    assert_equal(initial_deployed.models[0], previous_deployed.models[0])
    assert_equal(initial.trained[1], previous.trained[1])  # task 1 trained from the same model in both runs
    assert not torch.allclose(initial_deployed.models[1]["text_projection.weight"],
                              previous_deployed.models[1]["text_projection.weight"])


@pytest.mark.parametrize(("schedule", "averaged"), [("paper", [2, 4]), ("code", [1, 3, 5])])
def test_weight_ensemble_is_the_mean_of_its_snapshots(tmp_path, schedule, averaged):
    """5 steps per task, every 2: the deployed model is the mean of the task-start weights and the weights after the
    averaged steps (as the next step reads them), and the next task starts a new mean from it."""
    weights, deployed = Weights(), Deployed()
    learner = fit(tmp_path, ["weight_ensemble"], {"weight_ensemble": {"every": 2, "schedule": schedule}},
                  steps=5, batch=8, weights=weights, deployed=deployed)
    for task in range(2):
        assert sorted(weights.steps[task]) == [1, 2, 3, 4, 5]
        snapshots = [weights.start[task]] + [weights.steps[task][s] for s in averaged]
        mean = {k: torch.stack([s[k] for s in snapshots]).mean(0) for k in snapshots[0]}
        assert_close(deployed.models[task], mean)
        assert not torch.allclose(deployed.models[task]["text_projection.weight"],
                                  weights.trained[task]["text_projection.weight"])
    assert_equal(weights.start[1], deployed.models[0])
    assert learner.methods[0].history == {0: averaged, 1: averaged}
    assert learner.methods[0].state_dict()["ensemble"]["average"] is None  # nothing model-sized between tasks


def test_mid_task_resume_is_exact(tmp_path):
    """Stopped at the checkpoint of task 1's step 3, whose weights are due in the mean ("code": steps 1, 3, 5) but
    not averaged in yet, and resumed: the same deployed model and method states as the uninterrupted run (wise_ft's
    task-start reference comes back from the mid-task state)."""
    methods = ["weight_ensemble", "wise_ft"]
    options = {"weight_ensemble": {"every": 2, "schedule": "code"}, "wise_ft": {"alpha": 0.5, "reference": "previous"}}
    training = {"save_strategy": "steps", "save_steps": 3}
    common = {"steps": 5, "batch": 8, "training": training, "save_checkpoints": True}
    full = fit(tmp_path / "full", methods, options, **common)

    class Stop(Exception):
        pass

    class StopAtSave(TrainerCallback):
        task = -1

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            self.task += 1

        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
            if self.task == 1 and state.global_step == 3:
                raise Stop

    with pytest.raises(Stop):
        fit(tmp_path / "run", methods, options, weights=StopAtSave(), **common)
    saved = json.loads((tmp_path / "run" / "trainer" / "task-1" / "checkpoint-3" / "hf_ccl" /
                        "method_state.json").read_text())
    assert saved["weight_ensemble"]["state"]["ensemble"]["pending"] == 3
    assert saved["weight_ensemble"]["state"]["ensemble"]["steps"] == [1]
    resumed = fit(tmp_path / "run", methods, options, resume_from_checkpoint=True, **common)
    assert_close(_weights(resumed.model), _weights(full.model))
    for mine, theirs in zip(resumed.methods, full.methods, strict=True):
        assert_state_close(mine.state_dict(), theirs.state_dict())
    assert resumed.methods[0].history == full.methods[0].history == {0: [1, 3, 5], 1: [1, 3, 5]}


# ----------------------------------------------------------------------------------------------------------------
# Options and combinations
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "option", "value"), [
    ("wise_ft", "alpha", 1.5), ("wise_ft", "alpha", -0.1), ("wise_ft", "alpha", "high"),
    ("wise_ft", "reference", "zero_shot"), ("wise_ft", "continue_from", "average"),
    ("weight_ensemble", "every", 0), ("weight_ensemble", "every", 2.5), ("weight_ensemble", "schedule", "swa"),
    ("weight_ensemble", "offload", "yes"),
])
def test_bad_options_are_refused(method, option, value):
    with pytest.raises(ConfigError) as caught:
        build_methods([method], {method: {option: value}})
    assert caught.value.key == f"method_args.{method}.{option}", str(caught.value)
    assert f"method_args.{method}" in str(caught.value) and option in str(caught.value)


def test_defaults_and_combinations():
    wise, ensemble = build_methods(["weight_ensemble", "wise_ft"])[::-1]
    assert (wise.config.alpha, wise.config.reference, wise.config.continue_from) == (0.8, "initial", "finetuned")
    assert (ensemble.config.every, ensemble.config.schedule, ensemble.config.offload) == (100, "paper", False)
    with pytest.raises(ConfigError, match="Put 'weight_ensemble' before 'wise_ft'"):
        build_methods(["wise_ft", "weight_ensemble"])
    with pytest.raises(ConfigError, match="Put 'weight_ensemble' before 'lora'"):
        build_methods(["lora", "weight_ensemble"])
    build_methods(["weight_ensemble", "lora"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_methods(["wise_ft", "lora"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_methods(["restart", "wise_ft"])
