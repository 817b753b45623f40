"""ConDU (`hf_ccl.methods.condu`): the fusion, the prototypes and semantic voting checked by hand; a tiny run of the
`condu-mtil-bundled` recipe through the CLI, whose results are the decoupled experts' and semantic voting's scores,
computed here again from the checkpoint with `load_condu_model`; both inference modes; the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_ccl.data import load_tokenizer
from hf_ccl.evaluation import encode_images, evaluate_task, zero_shot_classifier
from hf_ccl.evaluation.evaluator import iter_column
from hf_ccl.evaluation.zeroshot import DEFAULT_TEMPLATES, accuracy_from_scores
from hf_ccl.methods import build_methods
from hf_ccl.methods.condu import (
    MODULE,
    ConDUExperts,
    added_to,
    class_prototypes,
    decouple,
    load_condu_model,
    semantic_voting_weights,
    unify,
)

TINY = "model.config={hidden_size: 32, num_layers: 1, num_heads: 2, image_size: 32, patch_size: 8, projection_dim: 32}"


# ----------------------------------------------------------------------------------------------------------------
# The formulas, by hand
# ----------------------------------------------------------------------------------------------------------------
def test_unify_and_decouple_by_hand():
    """Sign of the mean (0 -> -1), masks, U = s * max |M * delta|, rescalers summed over the tensors."""
    first = {"w": torch.tensor([[1.0, -2.0], [0.5, 0.0]]), "b": torch.tensor(0.5)}
    second = {"w": torch.tensor([[3.0, 1.0], [-1.0, 0.0]]), "b": torch.tensor(-0.1)}
    unified, masks, rescalers = unify([first, second])
    # mean w = [[2, -0.5], [-0.25, 0]] -> s = [[+, -], [-, -]]; mean b = 0.2 -> +
    assert torch.equal(masks[0]["w"], torch.tensor([[True, True], [False, False]]))
    assert torch.equal(masks[1]["w"], torch.tensor([[True, False], [True, False]]))
    assert masks[0]["b"].item() and not masks[1]["b"].item()
    assert torch.equal(unified["w"], torch.tensor([[3.0, -2.0], [-1.0, 0.0]]))
    assert unified["b"].item() == pytest.approx(0.5)
    # scales: (0.875 + 0.5, 1.25 + 0.1); masked: ((3 + 2) / 4 + 0.5, (3 + 1) / 4 + 0)
    assert rescalers.tolist() == pytest.approx([1.375 / 1.75, 1.35 / 1.0])
    expert = decouple(unified, masks[1], rescalers[1])
    assert torch.allclose(expert["w"], torch.tensor([[3.0, 0.0], [-1.0, 0.0]]) * 1.35)
    assert expert["b"].item() == 0.0


def _official_unify(deltas):
    """The official `unify_delta_models` (src/delta_models.py), transcribed loop for loop, as the reference."""
    scales = torch.zeros(len(deltas))
    unified, masks = {}, {}
    mean = {n: torch.stack([d[n] for d in deltas]).mean(0) for n in deltas[0]}
    for n in mean:
        masks[n] = []
        flag = (mean[n] > 0) * 2 - 1
        best = torch.zeros_like(deltas[0][n])
        for m, delta in enumerate(deltas):
            mask = (delta[n] * flag) > 0
            masks[n].append(mask)
            best = torch.where(torch.abs(mask * delta[n]) > best, torch.abs(mask * delta[n]), best)
            scales[m] += torch.mean(torch.abs(delta[n]))
        unified[n] = best * flag
    new_scales = torch.zeros(len(deltas))
    for m in range(len(deltas)):
        for n in unified:
            new_scales[m] += torch.mean(torch.abs(unified[n] * masks[n][m]))
    return unified, masks, scales / new_scales


def test_unify_matches_the_official_code_on_random_task_vectors():
    generator = torch.Generator().manual_seed(0)
    deltas = [{"a": torch.randn(5, 3, generator=generator), "b": torch.randn(4, generator=generator)}
              for _ in range(3)]
    unified, masks, rescalers = unify(deltas)
    reference, reference_masks, reference_rescalers = _official_unify(deltas)
    for name in unified:
        assert torch.equal(unified[name], reference[name].float())
        for index in range(3):
            assert torch.equal(masks[index][name], reference_masks[name][index])
    assert torch.allclose(rescalers, reference_rescalers, rtol=1e-6)


def test_class_prototypes_by_hand():
    images = torch.tensor([[2.0, 0.0], [0.0, 3.0]])  # class 0, normalised to [1, 0] and [0, 1]
    labels = torch.tensor([0, 0])
    text_means = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # class 1 has no images
    prototypes = class_prototypes(images, labels, text_means)
    expected = torch.tensor([0.75, 0.25]) / torch.tensor(0.625).sqrt()  # ((0.5, 0.5) + (1, 0)) / 2, normalised
    assert torch.allclose(prototypes[0], expected)
    assert torch.allclose(prototypes[1], torch.tensor([0.0, 1.0]))


def test_semantic_voting_weights_by_hand():
    image = torch.tensor([[1.0, 0.2]])
    sets = [torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.1]])]
    # similarity per task (max over its prototypes): task 1 ~ 0.98, task 2 ~ 0.99, task 0 ~ 0.2
    assert semantic_voting_weights(image, sets, 2)[0].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])
    assert semantic_voting_weights(image, sets, 1)[0].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.5])
    assert semantic_voting_weights(image, sets, 9)[0].tolist() == pytest.approx([0.25] * 4)  # k = min(top_k, T)


def test_added_to_restores_the_weights_bit_for_bit():
    layer = torch.nn.Linear(3, 2)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    delta = {"weight": torch.full((2, 3), 0.1)}
    with added_to(layer, delta):
        assert torch.allclose(layer.weight, before["weight"] + 0.1)
    assert all(torch.equal(p, before[name]) for name, p in layer.named_parameters())


# ----------------------------------------------------------------------------------------------------------------
# A tiny run of the recipe, through the CLI
# ----------------------------------------------------------------------------------------------------------------
TASKS = ["digits", "rsscn7", "pacs"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from hf_ccl.cli import main

    output = tmp_path_factory.mktemp("condu")
    overrides = [f"output_dir={output}", "progress=false", "training.max_steps=3",
                 "training.per_device_train_batch_size=8", "training.learning_rate=0.01", "model.pretrained=null",
                 f"stream_args={{max_train_per_task: 16, max_eval_per_task: 12, tasks: [{', '.join(TASKS)}]}}", TINY,
                 "method_args.condu={top_k: 1}"]
    assert main(["train", "--config", "condu-mtil-bundled", *overrides]) == 0
    return output


def _stream():
    from hf_ccl.data import build_stream

    return build_stream("mtil-bundled", max_train_per_task=16, max_eval_per_task=12, tasks=TASKS)


def test_the_checkpoint_weights_are_the_starting_model_and_the_experts_are_in_the_method_state(run):
    initial = load_file(str(run / "task-1" / "method_state.safetensors"))
    weights = load_file(str(run / "task-1" / "model.safetensors"))
    starting = {name.removeprefix("condu/initial/"): t for name, t in initial.items() if "/initial/" in name}
    assert starting and all(torch.equal(weights[name], tensor) for name, tensor in starting.items())
    state = json.loads((run / "task-1" / "method_state.json").read_text())["condu"]["state"]
    assert state["tasks"] == ["digits", "rsscn7"] and len(state["rescalers"]) == 2
    assert all(value > 0 for value in state["rescalers"])


def _scores_by_hand(model, task, tokenizer, image_processor, weights_of, names=None) -> float:
    """Accuracy of `task` from every variant's own image and class embeddings, mixed with `weights_of(frozen)`,
    among the task's classes or among `names`."""
    experts = getattr(model, MODULE)
    templates = list(task.eval_templates or DEFAULT_TEMPLATES)
    labels = torch.tensor(list(iter_column(task.eval, "label")))
    if names is not None:
        labels = torch.tensor([names.index(task.class_names[label]) for label in labels.tolist()])
    names = list(names or task.class_names)

    def embed() -> tuple[torch.Tensor, torch.Tensor]:
        images = encode_images(model, image_processor, iter_column(task.eval, "image"))
        classes = zero_shot_classifier(model, names, templates, tokenizer)
        return torch.nn.functional.normalize(images, dim=-1), classes

    frozen, frozen_classes = embed()
    weights = weights_of(frozen)
    scores = weights[:, :1] * (frozen @ frozen_classes.T)
    for index in range(len(experts.store.tasks)):
        with added_to(model, experts.store.expert(index)):
            images, classes = embed()
        scores += weights[:, index + 1 : index + 2] * (images @ classes.T)
    return accuracy_from_scores(scores, labels)["accuracy"]


def test_results_are_the_experts_and_semantic_voting_and_load_condu_model_gives_them(run):
    """After task 1 (digits, rsscn7 learned): a learned task is scored by its own expert (both towers), a task not
    learned (pacs-sketch) by θ0 and its top-1 prototype task, averaged. `load_condu_model` reproduces results.json."""
    from hf_ccl.families import default_image_processor

    results = json.loads((run / "results.json").read_text())
    row = next(row for row in results["rows"] if row["label"] == "rsscn7")["metrics"]
    model = load_condu_model(run / "task-1")
    assert isinstance(getattr(model, MODULE), ConDUExperts)
    tokenizer, image_processor = load_tokenizer(str(run / "task-1")), default_image_processor(model)
    tasks = {task.name: task for task in _stream().tasks}
    assert list(tasks) == ["digits", "rsscn7", "pacs-sketch"]

    def own_expert(index):
        return lambda frozen: torch.eye(3)[index + 1].expand(frozen.shape[0], 3)

    def voting(frozen):
        return semantic_voting_weights(frozen, getattr(model, MODULE).store.prototypes, 1)

    for name, weights_of in (("digits", own_expert(0)), ("rsscn7", own_expert(1)), ("pacs-sketch", voting)):
        by_hand = _scores_by_hand(model, tasks[name], tokenizer, image_processor, weights_of)
        assert row[name]["accuracy"] == pytest.approx(by_hand, abs=1e-4), name
        evaluated = evaluate_task(model, tasks[name], image_processor, tokenizer)
        assert evaluated["accuracy"] == pytest.approx(row[name]["accuracy"], abs=1e-4), name
    # among every class of the stream (X-TAIL's class_scope "all"): no task identity, semantic voting for all
    every = list(dict.fromkeys(name for task in tasks.values() for name in task.class_names))
    scoped = evaluate_task(model, tasks["digits"], image_processor, tokenizer, seen_class_names=every,
                           class_scope="all")
    assert scoped["accuracy"] == pytest.approx(row["digits"]["accuracy"], abs=1e-4)
    assert scoped["all_accuracy"] == pytest.approx(
        _scores_by_hand(model, tasks["digits"], tokenizer, image_processor, voting, names=every), abs=1e-4)
    # inference="agnostic": semantic voting for the learned tasks too
    getattr(model, MODULE).inference = "agnostic"
    agnostic = evaluate_task(model, tasks["digits"], image_processor, tokenizer)["accuracy"]
    assert agnostic == pytest.approx(_scores_by_hand(model, tasks["digits"], tokenizer, image_processor, voting),
                                     abs=1e-4)


def test_a_captioned_stream_and_conflicting_methods_are_refused(tmp_path, capsys):
    from hf_ccl.cli import main

    assert main(["train", "--config", "flickr8k-random5", "methods=[condu]", f"output_dir={tmp_path}",
                 "model.pretrained=null", TINY]) == 1  # refused once the stream is built, before training
    assert "condu scores tasks by their classes" in capsys.readouterr().err
    assert not (tmp_path / "task-0").exists()
    with pytest.raises(ValueError, match="weight_interpolation|deploys"):
        build_methods(["condu", "wise_ft"])
