"""MagMax (`magmax`): the merge by hand on a 3-task toy model (max magnitude with both tie rules, the average, random
mixing), the running merge against the merge over stored task vectors, real 2-task runs of a tiny CLIP on `digits`
(sequential and independent fine-tuning: what each task starts from and what is deployed), and the options and
combinations refused. Exact resume after a task is `tests/test_method_registry.py`'s every-method matrix."""

from __future__ import annotations

import json

import pytest
import torch
from test_wise_ft import Deployed, TwoParameters, Weights, _context, _weights, assert_close, assert_equal, fit

from hf_ccl.methods import build_methods
from hf_ccl.methods.magmax import MagMax, merge_task_vectors, task_vector
from hf_ccl.validation import ConfigError

# θ_0 = (w, b) = (1, 0); tasks train to these weights (w, b) from wherever they start.
TRAINED = [(3.0, -1.0), (0.0, -3.0), (-1.0, 2.0)]


def run_by_hand(options: dict) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(what each task starts from, what is deployed after it) for the three toy tasks."""
    method, model = MagMax(options), TwoParameters(1.0, 0.0)
    starts, deployed = [], []
    for index, trained in enumerate(TRAINED):
        context = _context(index, model)
        method.on_task_start(context)
        starts.append(model.values())
        model.set(*trained)
        method.after_training(context)
        deployed.append(model.values())
    return starts, deployed


@pytest.mark.parametrize(("options", "expected"), [
    # τ_1 = (2, -1), τ_2 = (-1, -3), τ_3 = (-2, 2); deployed = (1, 0) + 0.5 * merged.
    # merged: (2, -1); (2, -3) (|2| > |-1|, |-3| > |-1|); w ties |−2| = |2|: later (-2, -3), earlier (2, -3).
    ({}, [(2.0, -0.5), (2.0, -1.5), (0.0, -1.5)]),
    ({"ties": "earlier"}, [(2.0, -0.5), (2.0, -1.5), (2.0, -1.5)]),
    # the mean: (2, -1); (0.5, -2); (-1/3, -2/3)
    ({"merge": "average"}, [(2.0, -0.5), (1.25, -1.0), (1.0 - 1.0 / 6.0, -1.0 / 3.0)]),
    # λ = 1: θ_0 + merged
    ({"scale": 1.0}, [(3.0, -1.0), (3.0, -3.0), (-1.0, -3.0)]),
])
def test_the_merge_by_hand(options, expected):
    starts, deployed = run_by_hand(options)
    assert starts == [(1.0, 0.0), (3.0, -1.0), (0.0, -3.0)]  # sequential: from the last fine-tuned weights
    assert deployed == [pytest.approx(value, abs=1e-6) for value in expected]


def test_independent_training_starts_every_task_from_the_initial_model():
    starts, deployed = run_by_hand({"training": "independent"})
    assert starts == [(1.0, 0.0)] * 3
    assert deployed == [pytest.approx(value, abs=1e-6) for value in [(2.0, -0.5), (2.0, -1.5), (0.0, -1.5)]]


def test_random_mixing_takes_each_entry_from_one_task_uniformly():
    method, initial = MagMax({"merge": "random", "seed": 3}), {"w": torch.zeros(30_000)}
    method.initial = initial
    for value in (1.0, 2.0, 3.0):
        method._add(task_vector(initial, {"w": torch.full((30_000,), value)}))
    merged = method.merged["w"]
    shares = [float((merged == value).float().mean()) for value in (1.0, 2.0, 3.0)]
    assert sum(shares) == 1.0 and all(abs(share - 1 / 3) < 0.02 for share in shares), shares
    again = MagMax({"merge": "random", "seed": 3})
    again.initial = initial
    for value in (1.0, 2.0, 3.0):
        again._add(task_vector(initial, {"w": torch.full((30_000,), value)}))
    assert torch.equal(again.merged["w"], merged)  # seeded: a resumed run draws the same


@pytest.mark.parametrize("merge", ["max_magnitude", "average"])
@pytest.mark.parametrize("ties", ["later", "earlier"])
def test_the_running_merge_equals_the_merge_of_stored_task_vectors(merge, ties):
    """4 tasks of integer-valued vectors (many ties, of both signs): one running tensor set, as merged task by task,
    is the merge over all stored task vectors at once."""
    generator = torch.Generator().manual_seed(0)
    initial = {"a": torch.randint(-9, 9, (5, 7), generator=generator).float(),  # exact differences: ties stay ties
               "b": torch.randint(-9, 9, (3,), generator=generator).float()}
    vectors = [{name: torch.randint(-3, 4, t.shape, generator=generator).float() for name, t in initial.items()}
               for _ in range(4)]
    method = MagMax({"merge": merge, "ties": ties})
    method.initial = initial
    for vector in vectors:
        method._add(task_vector(initial, {name: initial[name] + vector[name] for name in initial}))
    assert_close(method.merged, merge_task_vectors(vectors, merge, ties))
    if merge == "max_magnitude":  # each entry is one task's, of the largest magnitude
        stack = torch.stack([v["a"] for v in vectors])
        assert torch.equal(method.merged["a"].abs(), stack.abs().max(0).values)


# ----------------------------------------------------------------------------------------------------------------
# Real 2-task runs
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["sequential", "independent"])
def magmax_run(request, tmp_path_factory):
    weights, deployed = Weights(), Deployed()
    learner = fit(tmp_path_factory.mktemp(request.param), ["magmax"], {"magmax": {"training": request.param}},
                  weights=weights, deployed=deployed)
    return request.param, weights, deployed, learner


def test_a_run_deploys_the_initial_model_plus_half_the_max_magnitude_merge(magmax_run):
    training, weights, deployed, learner = magmax_run
    initial = weights.start[0]
    if training == "sequential":
        assert_equal(weights.start[1], weights.trained[0])  # continues from the fine-tuned, not the merged weights
    else:
        assert_equal(weights.start[1], initial)
    vectors = [task_vector(initial, trained) for trained in weights.trained]
    for task in range(2):
        merged = merge_task_vectors(vectors[:task + 1])
        assert_close(deployed.models[task], {name: initial[name] + 0.5 * merged[name] for name in initial})
    assert not torch.allclose(deployed.models[1]["text_projection.weight"], weights.trained[1]["text_projection.weight"])
    method = learner.methods[0]
    assert method.count == 2 and (method.finetuned is not None) == (training == "sequential")


# ----------------------------------------------------------------------------------------------------------------
# Options and combinations
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("option", "value"), [
    ("scale", -0.5), ("scale", "half"), ("merge", "ties"), ("training", "joint"), ("ties", "random"), ("seed", -1),
])
def test_bad_options_are_refused(option, value):
    with pytest.raises(ConfigError) as caught:
        build_methods(["magmax"], {"magmax": {option: value}})
    assert caught.value.key == f"method_args.magmax.{option}", str(caught.value)


def test_defaults_and_combinations():
    (method,) = build_methods(["magmax"])
    config = method.config
    assert (config.scale, config.merge, config.training, config.ties) == (0.5, "max_magnitude", "sequential", "later")
    build_methods(["magmax", "lwf"])
    build_methods(["magmax", "er"])
    with pytest.raises(ConfigError, match="Put 'magmax' before 'lwf'"):  # the teacher must be θ_{t-1}, not the merge
        build_methods(["lwf", "magmax"])
    for other in (["wise_ft", "magmax"], ["magmax", "patching"], ["magmax", "lora"], ["weight_ensemble", "magmax"]):
        with pytest.raises(ConfigError, match="cannot be combined"):
            build_methods(other)


def test_a_model_of_other_shapes_is_refused_before_training():
    method, model = MagMax(), TwoParameters(1.0, 0.0)
    method.initial = {"w": torch.zeros(2), "b": torch.zeros(())}
    with pytest.raises(ValueError, match="magmax .*shape"):
        method.on_task_start(_context(0, model))
    assert _weights(model) == {"w": torch.tensor(1.0), "b": torch.tensor(0.0)}


# ----------------------------------------------------------------------------------------------------------------
# The command a user runs
# ----------------------------------------------------------------------------------------------------------------
def test_the_cli_saves_the_merged_model_and_the_state_to_continue(tmp_path, capsys):
    """`hf-ccl train --config digits methods=[magmax]` (5 tasks of one step): `hf-ccl list` names it; each task checkpoint, loaded
    by plain transformers, is θ_0 + λ τ_merged of its saved state; the state holds the fine-tuned weights the next
    task starts from, and its files on disk are the run's extra storage."""
    from safetensors.torch import load_file
    from transformers import CLIPModel

    from hf_ccl.cli import main

    assert main(["list"]) == 0 and "magmax" in capsys.readouterr().out
    output_dir = tmp_path / "run"
    assert main(["train", "--config", "digits", "model.config.hidden_size=32", "model.config.num_layers=1",
                 "stream_args.max_train_per_task=8", "stream_args.max_eval_per_task=4",
                 "training.per_device_train_batch_size=8", "evaluation.initial=false", "evaluation.every=5",
                 "methods=[magmax]", "method_args.magmax.scale=0.25",
                 "progress=false", f"output_dir={output_dir}"]) == 0
    costs = json.loads((output_dir / "compute.json").read_text())["tasks"]
    assert len(costs) == 5
    for index, cost in enumerate(costs):
        folder = output_dir / f"task-{index}"
        state = json.loads((folder / "method_state.json").read_text())["magmax"]
        tensors = load_file(folder / "method_state.safetensors")
        assert state["config"]["scale"] == 0.25 and state["state"]["count"] == index + 1
        model = CLIPModel.from_pretrained(folder).state_dict()
        initial = {k[len("magmax/initial/"):]: v for k, v in tensors.items() if k.startswith("magmax/initial/")}
        merged = {k[len("magmax/merged/"):]: v for k, v in tensors.items() if k.startswith("magmax/merged/")}
        finetuned = {k[len("magmax/finetuned/"):]: v for k, v in tensors.items() if k.startswith("magmax/finetuned/")}
        assert merged and set(merged) == set(finetuned) == {k for k, v in model.items() if v.is_floating_point()}
        for name, vector in merged.items():
            torch.testing.assert_close(model[name], initial[name] + 0.25 * vector, msg=name)
        assert not torch.equal(model["text_projection.weight"], finetuned["text_projection.weight"])
        assert cost["extra_storage_bytes"] == sum((folder / f"method_state.{s}").stat().st_size
                                                  for s in ("json", "safetensors"))
