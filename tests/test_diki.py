"""The `diki` method (DIKI, Tang et al. ECCV 2024): residual attention prompts, the per-task Gaussians, likelihood
routing and calibration, exact state, and the run as a user makes it (CLI, local Hub, the card's loader)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import CLIPModel

from hf_ccl.families import check_family_methods
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.diki import (
    CALIBRATED,
    REFUSED_FAMILIES,
    calibration_weights,
    diki_prompts,
    install_diki,
    load_diki_model,
    log_likelihoods,
    select_tasks,
    task_statistics,
    use_routes,
)
from hf_ccl.methods.trainable import requires_grad_flags, restore_flags
from hf_ccl.testing import random_image_inputs, tiny_model
from hf_ccl.validation import ConfigError

TEXTS = ["a photo of a seven", "two dogs play in the snow", "x"]


def _method(**options):
    return build_methods(["diki"], {"diki": {"prompt_length": 3, **options}})[0]


def _prompted(family="clip", tasks=1, values=0.0, **options):
    """A tiny model of `family` with `tasks` prompts per layer (values set to `values` x N(0, 1)), in eval mode, and
    the frozen copy it started as."""
    from hf_ccl.data.task import TaskStream

    model = tiny_model(family)
    frozen = copy.deepcopy(model).eval()
    flags = requires_grad_flags(model)
    method = _method(**options)
    for index in range(tasks):
        method.on_task_start(TaskContext(task_index=index, task=None, stream=TaskStream("s", []), model=model))
    if values:
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in diki_prompts(model).prompt_layers.values():
                for prompt in layer.prompts:
                    prompt[1].copy_(torch.randn(prompt[1].shape, generator=generator) * values)
    restore_flags(model, flags)
    return model.eval(), frozen, method


def _embed(model, images, tokenizer):
    tokens = tokenizer(TEXTS, padding=model.text_padding, max_length=16, truncation=True, return_tensors="pt")
    texts = model.text_inputs(tokens["input_ids"], tokens["attention_mask"])
    with torch.no_grad():
        return model.embed_images(**images), model.embed_texts(**texts)


# ----- options and families -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "key"), [
    ({"prompt_length": 0}, "prompt_length"), ({"depth": 0}, "depth"), ({"towers": ["audio"]}, "towers"),
    ({"towers": []}, "towers"), ({"calibration_scale": 0.0}, "calibration_scale"),
    ({"calibration_shift": math.inf}, "calibration_shift"), ({"selection": "dataset"}, "selection"),
    ({"eval_routing": "ddas"}, "eval_routing"), ({"covariance_ridge": 0.0}, "covariance_ridge"),
    ({"statistics_max_examples": 1}, "statistics_max_examples"), ({"n_ctx": 4}, "n_ctx"),
])
def test_bad_options_are_refused_naming_the_option(options, key):
    with pytest.raises(ConfigError) as caught:
        build_methods(["diki"], {"diki": options})
    assert caught.value.key == f"method_args.diki.{key}", caught.value.key
    assert "\n" not in str(caught.value)


def test_families_without_clip_attention_are_refused_with_the_reason():
    for family in REFUSED_FAMILIES:
        with pytest.raises(ValueError, match="diki: its text tower is an? .* no `self_attn.q_proj`"):
            check_family_methods(family, ["diki"])
    for family in ("clip", "siglip", "siglip2", "metaclip_2"):
        check_family_methods(family, ["diki"])
    with pytest.raises(ValueError, match="no CLIP-style attention layers"):
        install_diki(tiny_model("altclip"), _method().config)


# ----- the residual attention (interference-free integration) -------------------------------------------------------
def test_residual_attention_by_hand_on_one_layer():
    """out = attn(x) + lambda W_o softmax(Q P_K^T / sqrt(d_h)) P_V, per head, the prompts never mixed into the layer's
    own softmax: computed here with explicit loops over heads on the vision tower's first attention layer."""
    model, frozen, _ = _prompted(values=0.5)
    attention = model.vision_model.encoder.layers[0].self_attn
    plain = frozen.vision_model.encoder.layers[0].self_attn
    prompt = diki_prompts(model).prompt_layers["vision_0"].prompts[0].detach()
    x = torch.randn(2, 5, attention.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    heads, width = attention.num_heads, attention.q_proj.out_features
    size = width // heads
    with torch.no_grad():
        queries = attention.q_proj(x)
        residual = torch.zeros_like(queries)
        for h in range(heads):
            cols = slice(h * size, (h + 1) * size)
            scores = queries[..., cols] @ prompt[0][:, cols].T / math.sqrt(size)
            residual[..., cols] = scores.softmax(-1) @ prompt[1][:, cols]
        for weight in (1.0, 0.3):
            expected = plain(x)[0] + weight * residual @ attention.out_proj.weight.T
            with use_routes(model, 0, image_weights=weight):
                got = attention(x)[0]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        # per sample: lambda 0 and route -1 are the frozen layer exactly
        with use_routes(model, torch.tensor([-1, 0]), image_weights=torch.tensor([0.7, 0.0])):
            assert torch.equal(attention(x)[0], plain(x)[0])


@pytest.mark.parametrize("family", ["clip", "siglip", "siglip2", "metaclip_2"])
def test_zero_initialised_prompts_are_exactly_the_frozen_model(family, clip_tokenizer):
    """P_V = 0 at a task's start: the prompted model is the pre-trained one bit for bit, in both towers; prompts with
    values change both towers."""
    model, frozen, _ = _prompted(family, tasks=2, eval_routing="current")
    images = random_image_inputs(model, 3)
    plain = _embed(frozen, images, clip_tokenizer)
    for route in (0, 1):
        with use_routes(model, route):
            prompted = _embed(model, images, clip_tokenizer)
        assert torch.equal(prompted[0], plain[0]) and torch.equal(prompted[1], plain[1])
    model, frozen, _ = _prompted(family, values=0.5, eval_routing="current")
    prompted = _embed(model, images, clip_tokenizer)
    assert not torch.allclose(prompted[0], plain[0]) and not torch.allclose(prompted[1], plain[1])


# ----- the Gaussians, the likelihood and the calibration -------------------------------------------------------------
def test_task_statistics_likelihood_and_calibration_by_hand():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    mean, covariance = task_statistics(features, ridge=1e-7)
    torch.testing.assert_close(mean, torch.tensor([0.5, 0.5]))
    # unbiased: sum of squared deviations (4 x 0.25 = 1) over N - 1 = 3; cross terms sum to 0
    torch.testing.assert_close(covariance, torch.tensor([[1 / 3 + 1e-7, 0.0], [0.0, 1 / 3 + 1e-7]]))
    # log N(x; mu, diag(v, v)) = -0.5 (|x - mu|^2 / v + 2 log v + 2 log 2 pi), v = 1/3 (ridge ignored)
    x = torch.tensor([[0.5, 0.5], [1.5, 0.5]])
    v = 1 / 3
    expected = [-0.5 * (0.0 / v + 2 * math.log(v) + 2 * math.log(2 * math.pi)),
                -0.5 * (1.0 / v + 2 * math.log(v) + 2 * math.log(2 * math.pi))]
    second = (torch.tensor([2.0, 0.0]), torch.tensor([[2.0, 0.5], [0.5, 1.0]]))
    got = log_likelihoods(x, torch.stack([mean, second[0]]), torch.stack([covariance, second[1]]))
    torch.testing.assert_close(got[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    reference = torch.distributions.MultivariateNormal(second[0].double(), second[1].double()).log_prob(x.double())
    torch.testing.assert_close(got[:, 1], reference)
    # lambda = sigmoid(l / s - c): l = s gives 0.5 at c = 1, l = 2 s gives sigmoid(1)
    torch.testing.assert_close(calibration_weights(torch.tensor([512.0, 1024.0, -512.0]), 512.0, 1.0),
                               torch.tensor([0.5, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(2))]))
    # t*: per image, or the batch's most frequent (ties to the lowest task)
    likelihoods = torch.tensor([[0.0, 1.0, 0.5], [2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.0, 9.0]])
    assert select_tasks(likelihoods, "image").tolist() == [1, 0, 1, 2]
    assert select_tasks(likelihoods, "batch").tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="at least 2 training images"):
        task_statistics(features[:1])


def _two_gaussians(model, **options):
    """Two task Gaussians far apart in the model's embedding space, set by hand."""
    bank = diki_prompts(model)
    width = model.embed_dim
    first, second = torch.zeros(width), torch.zeros(width)
    first[0], second[1] = 1.0, 1.0
    for mean in (first, second):
        bank.add_statistics(mean, torch.eye(width) * 0.05)
    for key, value in options.items():
        setattr(bank.config, key, value)
    return bank


@pytest.mark.parametrize(("options", "scale"), [({}, None), ({"calibration_scale": 512.0}, 512.0)])
def test_evaluation_routes_pick_the_most_likely_task_and_keep_each_routes_mean_weight(options, scale):
    """The evaluator's routes: argmax_t l_t per image, each route's texts weighted by the mean lambda of its images;
    s defaults to the embedding width (the code's 512 for ViT-B/16), 512 as an option; `selection: batch` gives every
    image the majority task; `calibration: false` weights 1."""
    model, _, _ = _prompted(tasks=2)
    bank = _two_gaussians(model, **options)
    width = model.embed_dim
    embeds = torch.zeros(3, width)
    embeds[0, 0], embeds[1, 1], embeds[2, 1] = 1.0, 1.0, 0.9
    embeds[2, 2] = math.sqrt(1 - 0.81)
    routes = bank.evaluation_routes(embeds)
    assert routes.tolist() == [0, 1, 1]
    likelihoods = log_likelihoods(embeds, bank.means, bank.covariances)
    weights = torch.sigmoid(likelihoods.max(1).values / (scale or width) - 1.0)
    assert bank.route_text_weights[0] == pytest.approx(float(weights[0]))
    assert bank.route_text_weights[1] == pytest.approx(float(weights[1:].mean()))
    bank.config.selection = "batch"
    assert bank.evaluation_routes(embeds).tolist() == [1, 1, 1]
    bank.config.calibration = False
    bank.evaluation_routes(embeds)
    assert set(bank.route_text_weights.values()) == {1.0}


def test_calibrated_images_take_their_own_weight_from_their_frozen_embedding(clip_tokenizer):
    """Inside a route, `CALIBRATED` images are weighted by lambda(x) of their own frozen embedding: the same
    embeddings as passing those weights by hand; outside any block (eval_routing: likelihood) images also take their
    most likely task's prompt, texts the current one at lambda 1."""
    model, frozen, _ = _prompted(tasks=2, values=0.5)
    images = random_image_inputs(model, 4)
    with torch.no_grad():
        plain = frozen.embed_images(**images)
    bank = diki_prompts(model)
    bank.add_statistics(plain[:2].mean(0), torch.cov(plain.T) + 0.05 * torch.eye(plain.shape[1]))
    bank.add_statistics(plain[2:].mean(0) + 0.1, torch.cov(plain.T) + 0.05 * torch.eye(plain.shape[1]))
    likelihoods = log_likelihoods(plain, bank.means, bank.covariances)
    weights = torch.sigmoid(likelihoods.max(1).values / model.embed_dim - 1.0)
    routes = likelihoods.argmax(1)
    with torch.no_grad():
        with use_routes(model, 1, image_weights=CALIBRATED):
            calibrated = model.embed_images(**images)
        with use_routes(model, 1, image_weights=weights.float()):
            by_hand = model.embed_images(**images)
        torch.testing.assert_close(calibrated, by_hand, rtol=1e-5, atol=1e-6)
        default = _embed(model, images, clip_tokenizer)
        with use_routes(model, routes, image_weights=weights.float()):
            routed = model.embed_images(**images)
        with use_routes(model, 1):
            texts = _embed(model, images, clip_tokenizer)[1]
    torch.testing.assert_close(default[0], routed, rtol=1e-5, atol=1e-6)
    assert torch.equal(default[1], texts)


# ----- the run as a user makes it: the CLI, pushed to a Hub, loaded back as the card says ---------------------------
REPO = "hf-ccl-test/diki-digits"
CLI_RUN = ["train", "--config", "digits", "methods=[diki]", "model.config.hidden_size=32",
           "model.config.num_layers=1", "model.config.projection_dim=32", "stream_args.max_train_per_task=32",
           "stream_args.max_eval_per_task=16", "training.max_steps=2", "training.per_device_train_batch_size=16",
           "training.learning_rate=5.0", "training.warmup_steps=0", "method_args.diki={prompt_length: 4}",
           f"hub.model_id={REPO}"]


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory):
    """`hf-ccl train --config digits methods=[diki] ...` (5 tasks), pushed to the local Hub."""
    from types import SimpleNamespace

    from hf_ccl.cli import main
    from hf_ccl.testing import LocalHubServer

    root = tmp_path_factory.mktemp("diki-cli")
    with LocalHubServer(root / "hub") as server, server.patch_client(cache_dir=root / "cache"):
        code = main([*CLI_RUN, f"output_dir={root / 'out'}"])
        yield SimpleNamespace(code=code, output=root / "out", server=server)


def test_the_run_trains_only_prompts_and_saves_the_base_model(pushed_run):
    assert pushed_run.code == 0
    first, last = pushed_run.output / "task-0", pushed_run.output / "task-4"
    weights = load_file(str(last / "model.safetensors"))
    assert not any(key.startswith("diki") for key in weights)
    base = load_file(str(first / "model.safetensors"))
    assert all(torch.equal(base[key], weights[key]) for key in base)  # the backbone never moved
    model = load_diki_model(last)
    bank = diki_prompts(model)
    assert bank.num_prompts == bank.num_statistics == 5 and len(bank.layers) == 2  # 1 layer x 2 towers
    earlier = diki_prompts(load_diki_model(first))
    for key, layer in earlier.prompt_layers.items():  # task 0's prompts were not trained by later tasks
        assert torch.equal(layer.prompts[0], bank.prompt_layers[key].prompts[0])
        assert layer.prompts[0][1].abs().sum() > 0  # ... and did train (values start at zero)
    results = json.loads((pushed_run.output / "results.json").read_text())
    last_row = results["rows"][-1]["metrics"]
    for metrics in last_row.values():
        assert sum(v for k, v in metrics.items() if k.startswith("route_")) == pytest.approx(100.0)


@pytest.mark.parametrize("revision", [pytest.param("task-1", marks=pytest.mark.slow), "task-4"])
def test_the_cards_loader_gives_the_scored_model_and_the_evaluator_routes_by_hand(pushed_run, revision):
    """From the Hub revision, `load_diki_model` (the card's "How to use") scores exactly `results.json`; the evaluator's
    accuracy is the route-weighted mean of per-route accuracies computed here with explicit routes and weights."""
    from huggingface_hub import hf_hub_download

    from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
    from hf_ccl.evaluation.encode import encode_images
    from hf_ccl.evaluation.evaluator import evaluate_task
    from hf_ccl.evaluation.zeroshot import zero_shot_accuracy, zero_shot_classifier

    card = open(hf_hub_download(REPO, "README.md", revision=revision), encoding="utf-8").read()
    assert "load_diki_model" in card
    index = int(revision.split("-")[1])
    model = load_diki_model(REPO, revision=revision)
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=16)
    processor, tokenizer = load_image_processor(32), load_tokenizer()
    results = json.loads((pushed_run.output / "results.json").read_text())["rows"][index]["metrics"]
    bank = diki_prompts(model)
    for task in stream.tasks[: index + 1]:
        metrics = evaluate_task(model, task, processor, tokenizer, batch_size=64)
        assert metrics["accuracy"] == pytest.approx(results[task.name]["accuracy"], abs=1e-9), task.name
        images, labels = list(task.eval["image"]), torch.tensor(task.eval["label"])
        with use_routes(model, -1):
            frozen = torch.nn.functional.normalize(encode_images(model, processor, images), dim=-1)
        likelihoods = log_likelihoods(frozen, bank.means, bank.covariances)
        routes = likelihoods.argmax(1)
        weights = torch.sigmoid(likelihoods.max(1).values / model.embed_dim - 1.0).float()
        expected = 0.0
        for route in sorted(set(routes.tolist())):
            rows = torch.nonzero(routes == route).flatten()
            with use_routes(model, route, image_weights=weights[rows], text_weight=float(weights[rows].mean())):
                embeds = encode_images(model, processor, [images[i] for i in rows.tolist()], batch_size=len(rows))
                classes = zero_shot_classifier(model, task.class_names, task.eval_templates, tokenizer)
            expected += zero_shot_accuracy(embeds, labels[rows], classes)["accuracy"] * len(rows) / len(images)
            assert metrics[f"route_{route}"] == pytest.approx(100 * len(rows) / len(images))
            bank.evaluation_routes(frozen)  # the evaluator's own route block gives these embeddings
            with bank.evaluation_route(model, route):
                theirs = encode_images(model, processor, [images[i] for i in rows.tolist()])
                their_classes = zero_shot_classifier(model, task.class_names, task.eval_templates, tokenizer)
            torch.testing.assert_close(theirs, embeds, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(their_classes, classes, rtol=1e-5, atol=1e-6)
            with use_routes(model, route, text_weight=1.0):  # the texts' weight matters
                uncalibrated = zero_shot_classifier(model, task.class_names, task.eval_templates, tokenizer)
            assert not torch.allclose(uncalibrated, classes, rtol=1e-5, atol=1e-6)
        assert metrics["accuracy"] == pytest.approx(expected, abs=1e-6), task.name
    plain = CLIPModel.from_pretrained(REPO, revision=revision)  # plain transformers: the base model
    assert not any(name.startswith("diki") for name in plain.state_dict())


@pytest.mark.slow  # 11 s; the every-method matrix resumes DIKI exactly after a task by default
def test_resuming_mid_task_restores_the_prompts_and_gaussians_exactly(tmp_path, clip_tokenizer):
    """A task resumed from a Trainer checkpoint (whose model.safetensors holds no prompt) ends with exactly the prompts
    and Gaussians of an uninterrupted run."""
    import shutil

    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor
    from hf_ccl.data.task import TaskStream

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)

    def fit(resume):
        method = _method()
        args = ContinualArguments(
            output_dir=str(tmp_path), progress=False, evaluation={"initial": False, "batch_size": 64},
            resume_from_checkpoint=resume, keep_trainer_checkpoints=True,
            training={"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 1.0, "save_strategy": "steps",
                      "save_steps": 2})
        ContinualLearner(tiny_model(), TaskStream(stream.name, stream.tasks[:2]), [method], load_image_processor(32),
                         clip_tokenizer, args).fit()
        return method.state_dict()

    uninterrupted = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    resumed = fit(True)
    assert sorted(resumed["bank"]) == sorted(uninterrupted["bank"]) and resumed["num_prompts"] == 2
    for key, value in uninterrupted["bank"].items():
        torch.testing.assert_close(resumed["bank"][key], value, rtol=0, atol=0, msg=key)
    assert uninterrupted["bank"]["layers.vision_0.prompts.1"][1].abs().sum() > 0  # task 1's prompt trained
