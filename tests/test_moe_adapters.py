"""The `moe_adapters` method (MoE-Adapters, Yu et al. CVPR 2024): mixture-of-experts adapters with task routers,
activate-freeze, the DDAS auto-selector, the routing API, exact state and plain checkpoints."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import CLIPModel

from hf_ccl.accumulation import accumulated_backward
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import build_stream, load_image_processor
from hf_ccl.data.task import TaskStream
from hf_ccl.evaluation.fingerprint import tower_fingerprint
from hf_ccl.families import check_family_methods
from hf_ccl.methods import build_methods, load_method_states, save_method_states
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.moe_adapters import (
    REFUSED_FAMILIES,
    ExpertAdapter,
    MoEAdapters,
    balance_loss,
    cv_squared,
    ddas_features,
    has_routes,
    install_moe_adapters,
    load_moe_model,
    moe_bank,
    noisy_top_k_gating,
    num_routes,
    prob_in_top_k,
    select_routes,
    train_autoencoder,
    use_routes,
)
from hf_ccl.methods.trainable import requires_grad_flags, restore_flags
from hf_ccl.testing import random_image_inputs, tiny_model
from hf_ccl.validation import ConfigError

SMALL = {"num_experts": 4, "top_k": 2, "bottleneck": 4, "ddas_steps": 30, "ddas_code_dim": 8}
TEXTS = ["a photo of a seven", "two dogs play in the snow", "x"]


def _method(**options) -> MoEAdapters:
    return build_methods(["moe_adapters"], {"moe_adapters": {**SMALL, **options}})[0]


def _context(model, index=0, seed=0) -> TaskContext:
    return TaskContext(task_index=index, task=None, stream=TaskStream("s", []), model=model, seed=seed)


def _randomise(model, seed=1, scale=0.5) -> None:
    """Random experts and routers (they start at zero, which would make every route the frozen model)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("moe_adapters.") and "autoencoders" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)


def _adapted(family="clip", tasks=1, **options):
    """A tiny model of `family` with MoE adapters and `tasks` random task routers, in eval mode, and the frozen copy
    it started as."""
    model = tiny_model(family)
    frozen = copy.deepcopy(model).eval()
    flags = requires_grad_flags(model)
    method = _method(**options)
    for index in range(tasks):
        method.on_task_start(_context(model, index))
    _randomise(model)
    restore_flags(model, flags)  # as after a task (SigLIP's pooling head computes otherwise with frozen weights)
    return model.eval(), frozen, method


def _texts(model, tokenizer):
    tokens = tokenizer(TEXTS, padding=model.text_padding, max_length=16, truncation=True, return_tensors="pt")
    return model.text_inputs(tokens["input_ids"], tokens["attention_mask"])


def _embed(model, images, texts):
    with torch.no_grad():
        return model.embed_images(**images), model.embed_texts(**texts)


# ----- options and families -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "key"), [
    ({"top_k": 5, "num_experts": 4}, "top_k"), ({"top_k": 0}, "top_k"), ({"towers": ["audio"]}, "towers"),
    ({"towers": []}, "towers"), ({"dropout": 1.0}, "dropout"), ({"freeze_top": 5, "num_experts": 4}, "freeze_top"),
    ({"balance_weight": -1.0}, "balance_weight"), ({"ddas_quantile": 0.0}, "ddas_quantile"),
    ({"ddas_threshold": 0.0}, "ddas_threshold"), ({"eval_routing": "ddas", "ddas": False}, "eval_routing"),
    ({"ddas_selection": "dataset"}, "ddas_selection"), ({"num_experts": 0}, "num_experts"),
    ({"bottleneck": 0}, "bottleneck"), ({"ddas_lr": 0.0}, "ddas_lr"), ({"experts": 4}, "experts"),
])
def test_bad_options_are_refused_naming_the_option(options, key):
    with pytest.raises(ConfigError) as caught:
        build_methods(["moe_adapters"], {"moe_adapters": options})
    message = str(caught.value)
    assert caught.value.key == f"method_args.moe_adapters.{key}", caught.value.key
    assert "method_args.moe_adapters" in message and key in message and "\n" not in message, message


def test_families_with_other_layers_are_refused_with_the_reason():
    for family in REFUSED_FAMILIES:
        with pytest.raises(ValueError, match="moe_adapters: its text tower is an? .* post-LayerNorm"):
            check_family_methods(family, ["moe_adapters"])
    for family in ("clip", "siglip", "siglip2", "metaclip_2"):
        check_family_methods(family, ["moe_adapters"])
    with pytest.raises(ValueError, match="no CLIP-style encoder layers"):
        install_moe_adapters(tiny_model("altclip"), _method().config)


# ----- routes -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["clip", "siglip", "siglip2", "metaclip_2"])
def test_route_minus_one_is_exactly_the_frozen_model_and_a_task_route_is_not(family, clip_tokenizer):
    model, frozen, _ = _adapted(family, tasks=2)
    images, texts = random_image_inputs(model, 3), _texts(model, clip_tokenizer)
    plain_images, plain_texts = _embed(frozen, images, texts)
    with use_routes(model, -1):
        off_images, off_texts = _embed(model, images, texts)
    assert torch.equal(off_images, plain_images) and torch.equal(off_texts, plain_texts)
    with use_routes(model, 1):
        on_images, on_texts = _embed(model, images, texts)
    assert not torch.allclose(on_images, plain_images) and not torch.allclose(on_texts, plain_texts)
    assert torch.equal(_embed(model, images, texts)[0], on_images)  # eval default: the current (last) router
    # per sample: -1 rows are the frozen model's exactly, the others their own route's
    routes = torch.tensor([-1, 0, 1])
    with use_routes(model, 0):
        route0_images, route0_texts = _embed(model, images, texts)
    with use_routes(model, routes):
        mixed_images, mixed_texts = _embed(model, images, texts)
    for mixed, off, zero, one in ((mixed_images, plain_images, route0_images, on_images),
                                  (mixed_texts, plain_texts, route0_texts, on_texts)):
        assert torch.equal(mixed[0], off[0])
        torch.testing.assert_close(mixed[1], zero[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mixed[2], one[2], rtol=1e-5, atol=1e-6)


def test_use_routes_nests_validates_and_names_what_it_needs(clip_tokenizer):
    model, frozen, _ = _adapted(tasks=2)
    assert has_routes(model) and num_routes(model) == 2
    assert not has_routes(frozen) and num_routes(frozen) == 0
    with pytest.raises(ValueError, match="route 2 is not -1 or a trained task's router"):
        with use_routes(model, 2):
            pass
    with pytest.raises(ValueError, match=r"routes must be in \[-1, 1\]"):
        with use_routes(model, torch.tensor([0, -2])):
            pass
    with pytest.raises(ValueError, match="no MoE adapters"):
        with use_routes(frozen, 0):
            pass
    images = random_image_inputs(model, 3)
    with use_routes(model, torch.tensor([0, 1])), pytest.raises(ValueError, match="2 routes for a batch of 3"):
        model.embed_images(**images)
    bank = moe_bank(model)
    default = tower_fingerprint(model, "image").digest
    with use_routes(model, -1):
        with use_routes(model, 0):
            assert bank.state.routes == 0
            assert tower_fingerprint(model, "image").digest != default  # the evaluator's cache sees the route
        assert bank.state.routes == -1
    assert bank.state.is_default() and tower_fingerprint(model, "image").digest == default
    with use_routes(model, None):  # the training default: the current task's router
        assert torch.equal(model.embed_images(**images), _embed(model, images, _texts(model, clip_tokenizer))[0])


def test_eval_routing_frozen_default():
    model, frozen, _ = _adapted(tasks=1, eval_routing="frozen")
    images = random_image_inputs(model, 2)
    with torch.no_grad():
        assert torch.equal(model.embed_images(**images), frozen.embed_images(**images))


# ----- gating, experts and the balance loss, by hand ------------------------------------------------------------------
def test_top_k_gating_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    w_gate = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.0, 1.0, 4.0]])  # logits: [1,3,2,0], [1,0,2,8], [1.5,3,3,4]
    gating = noisy_top_k_gating(x, w_gate, None, k=2, noisy=False)
    expected = torch.zeros(3, 4)
    expected[0, 1], expected[0, 2] = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))  # softmax(3, 2)
    expected[1, 3], expected[1, 2] = 1 / (1 + math.exp(-6)), 1 / (1 + math.exp(6))  # softmax(8, 2)
    expected[2, 3] = 1 / (1 + math.exp(-1))  # softmax(4, 3): the tie of experts 1 and 2 goes to one of them
    torch.testing.assert_close(gating.gates[:2], expected[:2])
    assert gating.gates[2, 3] == pytest.approx(expected[2, 3]) and gating.gates[2, 0] == 0
    assert gating.gates[2, 1:3].sum() == pytest.approx(1 - expected[2, 3].item())
    assert ((gating.gates > 0).sum(1) == 2).all()
    torch.testing.assert_close(gating.gates.sum(1), torch.ones(3))
    torch.testing.assert_close(gating.importance, gating.gates.sum(0))
    assert gating.load.tolist() == (gating.gates > 0).sum(0).float().tolist()
    # with noise: still exactly k nonzero gates per sample, summing to 1
    torch.manual_seed(0)
    noisy = noisy_top_k_gating(torch.randn(64, 2), w_gate, torch.randn(2, 4), k=2, noisy=True)
    assert ((noisy.gates > 0).sum(1) == 2).all()
    torch.testing.assert_close(noisy.gates.sum(1), torch.ones(64))
    assert noisy.load.requires_grad is False and 0 < noisy.load.sum() < 64 * 4


def test_prob_in_top_k_by_hand():
    clean = torch.tensor([[0.0, 1.0, 2.0]])
    noisy = torch.tensor([[0.5, 1.5, 1.0]])  # sorted: 1.5 (expert 1), 1.0 (2), 0.5 (0); k = 1
    std = torch.ones(1, 3)
    top = torch.tensor([[1.5, 1.0]])
    prob = prob_in_top_k(clean, noisy, std, top, k=1)
    normal = torch.distributions.Normal(0.0, 1.0)
    # expert 1 is in (its threshold: the 2nd largest, 1.0); experts 0 and 2 are out (threshold: the largest, 1.5)
    expected = torch.tensor([[normal.cdf(torch.tensor(-1.5)), normal.cdf(torch.tensor(0.0)),
                              normal.cdf(torch.tensor(0.5))]])
    torch.testing.assert_close(prob, expected)


def test_cv_squared_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, unbiased variance (4 + 1 + 0 + 9) / 3 = 14 / 3
    assert cv_squared(x).item() == pytest.approx((14 / 3) / (9 + 1e-10))
    assert cv_squared(torch.tensor([5.0])).item() == 0.0
    assert cv_squared(torch.full((4,), 2.0)).item() == 0.0
    assert balance_loss(x, torch.tensor([2.0, 2.0])).item() == pytest.approx(14 / 27)


def test_mixture_is_the_gated_sum_of_the_chosen_experts():
    model, _, _ = _adapted(tasks=1)
    layer = moe_bank(model).layers["vision_0"]
    x = torch.randn(3, 5, layer.dim)
    gating = noisy_top_k_gating(x[:, 0], layer.routers[0], None, k=2, noisy=False)
    expected = sum(gating.gates[:, i, None, None] * expert(x) for i, expert in enumerate(layer.experts))
    torch.testing.assert_close(layer.mixture(x, gating), expected, rtol=1e-5, atol=1e-6)
    adapter = ExpertAdapter(8, 4, 0.1, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(adapter(torch.randn(2, 8)), torch.zeros(2, 8))  # zero up-projection: starts as the identity


def test_balance_term_is_the_weighted_sum_over_layers_and_the_code_variant_has_none(clip_tokenizer):
    model = tiny_model("clip")
    method = _method(router_noise=False)
    context = _context(model)
    method.on_task_start(context)
    _randomise(model)
    model.train()
    inputs = {**_texts(model, clip_tokenizer), **random_image_inputs(model, 3)}
    captured = {}  # each layer's gates, as its forward computed them
    bank = moe_bank(model)
    for key, layer in bank.layers.items():
        original = layer.mixture

        def spy(x, gating, key=key, original=original):
            captured[key] = gating.gates.detach()
            return original(x, gating)

        layer.mixture = spy
    outputs = model(**inputs, return_loss=True)
    terms = method.loss_terms(model, inputs, outputs, context)
    expected = sum(cv_squared(gates.sum(0)) + cv_squared((gates > 0).sum(0).float()) for gates in captured.values())
    assert sorted(captured) == ["text_0", "vision_0"]
    torch.testing.assert_close(terms["balance"], 1e-2 * expected)
    terms["balance"].backward()
    assert bank.layers["vision_0"].routers[0].grad.abs().sum() > 0
    code = _method(balance_weight=0.0)
    assert code.loss_terms(model, inputs, outputs, context) == {}


def _accumulation_step(tokenizer, texts, mode):
    """The loss and the gradients of one step on 8 examples: one batch ("whole"), or exact accumulation of 4 + 4."""
    model = tiny_model("clip")
    method = _method(router_noise=False, dropout=0.0)
    context = _context(model)
    method.on_task_start(context)
    _randomise(model, scale=0.3)
    model.train()
    tokens = tokenizer(texts, padding=True, return_tensors="pt")
    batch = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
             **random_image_inputs(model, 8)}

    def total(inputs, outputs):
        return outputs.loss + method.loss_terms(model, inputs, outputs, context)["balance"]

    def encode(chunk):
        out = model(**chunk, features_only=True)
        return out.image_features, out.text_features

    def batch_loss(merged, image, text):
        return total(merged, model.contrastive_outputs(image, text, return_loss=True))

    if mode == "whole":
        loss = total(batch, model(**batch, return_loss=True))
        loss.backward()
    else:
        chunks = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 4), slice(4, 8))]
        loss = accumulated_backward(chunks, encode, batch_loss, list(model.parameters()), lambda s: s.backward())
    assert not moe_bank(model).state.pending  # every chunk got its share
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_balance_term_is_exact_under_gradient_accumulation(clip_tokenizer):
    """Chunks of 4 + 4 (encoded without gradients, the term computed over all 8, its gradient injected into each
    chunk's second forward) give the routers and experts the gradients of one batch of 8."""
    texts = ["a photo of a cat", "a dog", "two birds", "a red car", "the sea", "a digit 7", "snow", "x"]
    grads = {mode: _accumulation_step(clip_tokenizer, texts, mode) for mode in ("whole", "chunks")}
    (whole_loss, whole), (chunk_loss, chunked) = grads["whole"], grads["chunks"]
    assert chunk_loss == pytest.approx(whole_loss, rel=1e-5)
    assert sorted(whole) == sorted(chunked) and any("routers" in name for name in whole)
    for name, grad in whole.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-7, msg=name)


# ----- DDAS ---------------------------------------------------------------------------------------------------------
def _images(kind: str, count: int, generator: torch.Generator) -> torch.Tensor:
    """Pixel batches of clearly different distributions: reddish and bluish images; noise and stripes (neither)."""
    pixels = torch.rand(count, 3, 32, 32, generator=generator) * 0.3
    if kind == "red":
        pixels[:, 0] += 1.5
    elif kind == "blue":
        pixels[:, 2] += 1.5
    elif kind == "noise":
        pixels = torch.randn(count, 3, 32, 32, generator=generator) * 2
    elif kind == "stripes":
        pixels[..., ::2] += 2.0
    return pixels


@pytest.mark.parametrize("selection", ["image", "batch"])
def test_ddas_picks_each_tasks_router_and_the_frozen_model_out_of_distribution(selection):
    model, _, method = _adapted(tasks=2, ddas_selection=selection)
    bank = moe_bank(model)
    generator = torch.Generator().manual_seed(0)
    for index, kind in enumerate(("red", "blue")):
        with torch.no_grad(), use_routes(model, -1):
            features = ddas_features(model.embed_images(pixel_values=_images(kind, 64, generator)))
        autoencoder, errors = train_autoencoder(features, code_dim=16, steps=40, seed=index)
        bank.add_autoencoder(autoencoder, float(torch.quantile(errors, 0.99)) * 1.5)
    for kind, route in (("red", 0), ("blue", 1), ("noise", -1), ("stripes", -1)):
        routes = select_routes(model, {"pixel_values": _images(kind, 16, generator)})
        assert routes.dtype == torch.int64 and routes.tolist() == [route] * 16, (kind, routes)
    mixed = torch.cat([_images("red", 2, generator), _images("blue", 2, generator), _images("noise", 2, generator)])
    routes = select_routes(model, {"pixel_values": mixed})
    if selection == "image":
        assert routes.tolist() == [0, 0, 1, 1, -1, -1]
    else:  # the official code: one route for the batch, from its mean errors
        assert len(set(routes.tolist())) == 1
    bank.ddas_threshold = 1.0  # an absolute threshold (the code's --threshold) above every error: nothing is refused
    assert -1 not in select_routes(model, {"pixel_values": _images("noise", 4, generator)}).tolist()


def test_eval_routing_ddas_routes_each_image_as_select_routes_does():
    model, _, _ = _adapted(tasks=2, eval_routing="ddas")
    bank = moe_bank(model)
    generator = torch.Generator().manual_seed(0)
    for index, kind in enumerate(("red", "blue")):
        with torch.no_grad(), use_routes(model, -1):
            features = ddas_features(model.embed_images(pixel_values=_images(kind, 64, generator)))
        autoencoder, errors = train_autoencoder(features, code_dim=16, steps=40, seed=index)
        bank.add_autoencoder(autoencoder, float(torch.quantile(errors, 0.99)) * 1.5)
    pixels = torch.cat([_images("red", 2, generator), _images("blue", 2, generator), _images("noise", 2, generator)])
    routes = select_routes(model, {"pixel_values": pixels})
    assert routes.tolist() == [0, 0, 1, 1, -1, -1]
    with torch.no_grad():
        default = model.embed_images(pixel_values=pixels)
        with use_routes(model, routes):
            explicit = model.embed_images(pixel_values=pixels)
    assert torch.equal(default, explicit)
    assert not bank.state.tower_routes  # cleared after the forward


# ----- training, checkpoints and state ------------------------------------------------------------------------------
def _stream(tasks: int = 2) -> TaskStream:
    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=16)
    return TaskStream(stream.name, stream.tasks[:tasks])


class _Recorder(MoEAdapters):
    """Keeps the adapters as each task's training left them (before its activate-freeze and autoencoder)."""

    def __init__(self, config=None):
        super().__init__(config)
        self.trained: dict[int, dict[str, torch.Tensor]] = {}

    def after_training(self, context):
        bank = moe_bank(context.model)
        self.trained[context.task_index] = {k: v.clone() for k, v in bank.state_dict().items()}
        super().after_training(context)


def _fit(tmp_path, tokenizer, options=None, tasks=2, training=None, **arguments):
    model = tiny_model("clip")
    methods = [_Recorder({**SMALL, **(options or {})})]
    evaluation = {"batch_size": 64, **arguments.pop("evaluation", {})}
    args = ContinualArguments(output_dir=str(tmp_path), progress=False, evaluation=evaluation,
                              training={"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 5e-2,
                                        **(training or {})}, **arguments)
    learner = ContinualLearner(model, _stream(tasks), methods, load_image_processor(32), tokenizer, args)
    learner.fit()
    return learner, methods[0]


def test_two_task_run_trains_only_adapters_freezes_experts_and_saves_a_plain_checkpoint(tmp_path, clip_tokenizer):
    initial = tiny_model("clip").state_dict()
    learner, method = _fit(tmp_path, clip_tokenizer)
    model, bank = learner.model, moe_bank(learner.model)
    # the base model did not move; the adapters and the routers did
    for key, value in model.state_dict().items():
        if not key.startswith("moe_adapters."):
            assert torch.equal(value, initial[key]), key
    assert num_routes(model) == 2 and len(bank.autoencoders) == 2 and bank.thresholds.shape == (2,)
    for layer in bank.layers.values():
        assert layer.routers[0].abs().sum() > 0 and layer.routers[1].abs().sum() > 0
        assert 1 <= int(layer.frozen.sum()) <= 4  # the 2 most chosen experts of each task
    # task 1 left task 0's router and the experts task 0 froze exactly as they were; the other experts trained
    before, after = method.trained[0], method.trained[1]
    changed = 0
    for key, layer in bank.layers.items():
        prefix = f"layers.{key}."
        for name in ("routers.0", "noise.0"):
            assert torch.equal(after[prefix + name], before[prefix + name]), name
        assert after[prefix + "routers.1"].abs().sum() > 0 and after[prefix + "noise.1"].abs().sum() > 0
        frozen = after[prefix + "frozen"]  # task 0's two most chosen experts
        assert int(frozen.sum()) == 2 and bool((layer.frozen & frozen).sum() == 2)
        for index in range(4):
            names = [prefix + f"experts.{index}.{part}" for part in ("down_proj.weight", "down_proj.bias",
                                                                     "up_proj.weight", "up_proj.bias")]
            same = all(torch.equal(after[name], before[name]) for name in names)
            assert same or not frozen[index], (key, index)
            changed += not same
    assert changed
    # trainable fraction: the adapters and one router (+ noise weights) per layer, a small share of the model
    counts = method.counts
    experts = 2 * 4 * (32 * 4 + 4 + 4 * 32 + 32)
    routers = 2 * 2 * 32 * 4
    assert counts["base"] == sum(v.numel() for v in initial.values())
    assert counts["trainable"] <= experts + routers and counts["trainable"] / counts["base"] < 0.01
    assert learner.compute[0].trainable_parameters == experts + routers  # nothing frozen before task 0
    assert learner.compute[1].trainable_parameters == counts["trainable"] < experts + routers
    # the checkpoint is the frozen base model: plain transformers loads it (the frozen model, route -1)
    folder = tmp_path / "task-1"
    assert not any(key.startswith("moe_adapters") for key in load_file(str(folder / "model.safetensors")))
    plain = CLIPModel.from_pretrained(folder)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, initial[key]), key
    # ... and with the method state, the model the run evaluated (same routes, same DDAS)
    restored = load_moe_model(folder)
    images, texts = random_image_inputs(model, 3), _texts(model, clip_tokenizer)
    model.eval()
    for route in (-1, 0, 1):
        with use_routes(model, route), use_routes(restored, route):
            mine, theirs = _embed(model, images, texts), _embed(restored, images, texts)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1]), route
    assert torch.equal(select_routes(model, images), select_routes(restored, images))


def test_state_round_trip_restores_everything_exactly(tmp_path, clip_tokenizer):
    model, _, method = _adapted(tasks=2)
    bank = moe_bank(model)
    generator = torch.Generator().manual_seed(0)
    features = ddas_features(torch.nn.functional.normalize(torch.randn(32, 32, generator=generator), dim=-1))
    bank.add_autoencoder(train_autoencoder(features, code_dim=8, steps=20)[0], 0.25)
    bank.layers["vision_0"].frozen[1] = True
    bank.layers["text_0"].counts += torch.tensor([3, 0, 1, 0])
    save_method_states([method], tmp_path)
    fresh = build_methods(["moe_adapters"], {"moe_adapters": SMALL})
    load_method_states(fresh, tmp_path)
    assert sorted(fresh[0].state_dict()) == sorted(method.state_dict())
    for key, value in method.state_dict()["bank"].items():
        assert torch.equal(fresh[0].state_dict()["bank"][key], value), key
    other = tiny_model("clip")
    fresh[0].on_task_start(_context(other, 2))  # installs the saved adapters, then task 2's router
    assert num_routes(other) == 3
    other_bank = moe_bank(other)
    assert other_bank.layers["vision_0"].frozen.tolist() == [False, True, False, False]
    assert other_bank.thresholds.tolist() == [0.25]
    assert not other_bank.layers["vision_0"].experts[1].down_proj.weight.requires_grad
    images, texts = random_image_inputs(model, 3), _texts(model, clip_tokenizer)
    other.eval()
    for route in (0, 1):
        with use_routes(model, route), use_routes(other, route):
            assert torch.equal(_embed(model, images, texts)[0], _embed(other, images, texts)[0])


def test_resuming_mid_task_restores_routers_counts_and_experts(tmp_path, clip_tokenizer):
    """A task resumed from a Trainer checkpoint (model.safetensors holds no adapter) ends with exactly the adapters,
    routers, choice counts and autoencoders of an uninterrupted run, router noise and dropout included."""
    training = {"save_strategy": "steps", "save_steps": 2}

    def fit(resume):
        learner, method = _fit(tmp_path, clip_tokenizer, {"router_noise": True, "dropout": 0.1}, training=training,
                               resume_from_checkpoint=resume, keep_trainer_checkpoints=True,
                               evaluation={"initial": False})
        return method.state_dict()

    uninterrupted = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    resumed = fit(True)
    assert sorted(resumed["bank"]) == sorted(uninterrupted["bank"])
    for key, value in uninterrupted["bank"].items():
        torch.testing.assert_close(resumed["bank"][key], value, rtol=0, atol=0, msg=key)
    for key, value in uninterrupted["counts"].items():
        assert torch.equal(resumed["counts"][key], value), key


def test_the_evaluator_scores_each_route_with_its_own_image_and_text_embeddings(tmp_path):
    """After 2 tasks with DDAS, `evaluate_task` routes every eval image by DDAS and scores it with that route's image
    AND class-prompt embeddings: the accuracy is the route-weighted mean of per-route accuracies computed by hand, the
    route shares add up to 100, and with every image refused (threshold ~0) it is exactly the frozen model's."""
    from hf_ccl.data import load_tokenizer
    from hf_ccl.evaluation.evaluator import evaluate_task
    from hf_ccl.evaluation.zeroshot import zero_shot_accuracy, zero_shot_classifier
    from hf_ccl.families import default_image_processor

    stream = _stream()
    model = tiny_model()
    frozen = copy.deepcopy(model).eval()
    processor, tokenizer = default_image_processor(model), load_tokenizer()
    args = ContinualArguments(output_dir=str(tmp_path), save_checkpoints=False, progress=False, evaluation={"initial": False},
                              training={"max_steps": 3, "per_device_train_batch_size": 16})
    learner = ContinualLearner(model, stream, build_methods(["moe_adapters"], {"moe_adapters": SMALL}),
                               processor, tokenizer, args)
    learner.fit()
    model, task = learner.model.eval(), stream[0]
    metrics = evaluate_task(model, task, processor, tokenizer)
    shares = {k: v for k, v in metrics.items() if k.startswith("route_")}
    assert sum(shares.values()) == pytest.approx(100.0)
    assert any(name != "route_frozen" for name in shares)  # task 0's images reach a task router

    from hf_ccl.evaluation.encode import encode_images

    bank = moe_bank(model)
    images = list(task.eval["image"])
    labels = torch.tensor(task.eval["label"])
    with use_routes(model, -1):
        routes = bank.select(torch.nn.functional.normalize(encode_images(model, processor, images), dim=-1))
    expected = 0.0
    for route in sorted(set(routes.tolist())):
        rows = torch.nonzero(routes == route).flatten()
        with use_routes(model, route):
            embeds = encode_images(model, processor, [images[i] for i in rows.tolist()])
            classes = zero_shot_classifier(model, task.class_names, task.eval_templates, tokenizer)
        expected += zero_shot_accuracy(embeds, labels[rows], classes)["accuracy"] * len(rows) / len(images)
    assert metrics["accuracy"] == pytest.approx(expected, abs=1e-6)

    bank.ddas_threshold = 1e-12  # every image out of distribution: the frozen model, exactly
    refused = evaluate_task(model, task, processor, tokenizer)
    assert refused["route_frozen"] == 100.0
    assert refused["accuracy"] == evaluate_task(frozen, task, processor, tokenizer)["accuracy"]


# ----- the run as a user makes it: the CLI, pushed to a Hub, loaded back as the card says ---------------------------
REPO = "hf-ccl-test/moe-digits"
CLI_RUN = ["train", "--config", "digits", "methods=[moe_adapters]", "model.config.hidden_size=32",
           "model.config.num_layers=1", "model.config.projection_dim=32", "stream_args.max_train_per_task=32",
           "stream_args.max_eval_per_task=16", "training.max_steps=2", "training.per_device_train_batch_size=16",
           "training.gradient_accumulation_steps=2", "training.learning_rate=1.0", "training.warmup_steps=0",
           "method_args.moe_adapters={num_experts: 4, bottleneck: 8, ddas_steps: 20, ddas_code_dim: 8}",
           f"hub.model_id={REPO}"]


@pytest.fixture(scope="module")
def pushed_run(tmp_path_factory):
    """`hf-ccl train --config digits methods=[moe_adapters] ...` (expert dropout and router noise at their defaults,
    32 x 2 accumulated steps), pushed to the local Hub. Records each accumulated step's features: each chunk's from
    its no-grad pass, then from its re-encoding."""
    from types import SimpleNamespace

    import hf_ccl.trainer
    from hf_ccl.cli import main
    from hf_ccl.testing import LocalHubServer

    root = tmp_path_factory.mktemp("moe-cli")
    steps, real = [], hf_ccl.trainer.accumulated_backward

    def recorded(chunks, encode, *args, **kwargs):
        seen = []

        def recording(chunk):
            features = encode(chunk)
            seen.append(tuple(feature.detach().clone() for feature in features))
            return features

        loss = real(chunks, recording, *args, **kwargs)
        steps.append((seen[: len(chunks)], seen[len(chunks):]))
        return loss

    with LocalHubServer(root / "hub") as server, server.patch_client(cache_dir=root / "cache"), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_ccl.trainer, "accumulated_backward", recorded)
        code = main([*CLI_RUN, f"output_dir={root / 'out'}"])
        patch.undo()
        yield SimpleNamespace(code=code, output=root / "out", steps=steps, server=server)


def test_accumulated_steps_re_encode_exactly_what_the_loss_saw(pushed_run):
    """With dropout and noisy gating on, every chunk's differentiable re-encoding (through the trainer's own
    closures) gives bit for bit the features of its no-grad pass: the step's gradient is that of the loss it logged."""
    assert pushed_run.code == 0
    assert len(pushed_run.steps) == 5 * 2  # 5 tasks x 2 steps, each of 2 chunks
    for first, second in pushed_run.steps:
        assert len(first) == len(second) == 2
        for (image, text), (image_again, text_again) in zip(first, second, strict=True):
            assert torch.equal(image, image_again) and torch.equal(text, text_again)


def _card_snippet(card_text: str) -> str:
    """The card's Python block that calls the method's loader."""
    blocks = card_text.split("```python\n")[1:]
    return next(block.split("```")[0] for block in blocks if "load_moe_model(" in block)


def _scores(model, processor, stream) -> dict[str, float]:
    from hf_ccl.evaluation import evaluate_task

    return {task.name: evaluate_task(model, task, processor.image_processor, processor.tokenizer)["accuracy"]
            for task in stream}


@pytest.mark.parametrize("revision", ["task-1", "task-4"])
def test_the_cards_loader_gives_the_scored_model_and_plain_transformers_the_base_model(pushed_run, revision):
    """The card's "How to use" of a pushed revision names `load_moe_model`; its snippet, run as printed, gives the
    model whose evaluation reproduces that revision's row of results.json exactly. `from_pretrained` gives what the
    card says: the frozen base model, the very weights the run started from (its scores: the `initial` row)."""
    import json
    from pathlib import Path

    from huggingface_hub import hf_hub_download
    from transformers import AutoModel, AutoProcessor

    card = Path(hf_hub_download(REPO, "README.md", revision=revision)).read_text(encoding="utf-8")
    snippet = _card_snippet(card)
    assert f'load_moe_model("{REPO}", revision="{revision}")' in snippet
    assert "base model without the adapters" in card and "does not score" in card
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102 (the card's own code, as a user runs it)
    loaded = namespace["model"]
    results = json.loads(Path(hf_hub_download(REPO, "results.json", revision=revision)).read_text(encoding="utf-8"))
    row = results["rows"][int(revision.split("-")[1])]["metrics"]
    initial = {task: metrics["accuracy"] for task, metrics in results["initial"]["metrics"].items()}
    processor = AutoProcessor.from_pretrained(REPO, revision=revision)
    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=16)
    assert _scores(loaded, processor, stream) == {task: metrics["accuracy"] for task, metrics in row.items()}
    plain = AutoModel.from_pretrained(REPO, revision=revision)
    assert type(plain) is CLIPModel
    start = tiny_model("clip", seed=0, hidden_size=32, num_layers=1, projection_dim=32).state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, start[key]), key
    assert _scores(plain, processor, stream) == initial
    assert {task: metrics["accuracy"] for task, metrics in row.items()} != initial  # the two models differ


# ----- sizes: refused before anything is built ----------------------------------------------------------------------
TINY_SIZES = {"hidden_size": 32, "num_layers": 1, "projection_dim": 32}


@pytest.mark.parametrize(("option", "value"), [("num_experts", 100000), ("bottleneck", 100000)])
def test_absurd_sizes_are_refused_by_the_cli_before_anything_is_built(tmp_path, capsys, option, value):
    """`num_experts=100000` used to fail with a MemoryError after minutes: it is refused at once (exit 2, nothing
    written), the message giving the parameters it implies against the model's own."""
    from hf_ccl.cli import main

    code = main(["train", "--config", "digits", "methods=[moe_adapters]",
                 *(f"model.config.{key}={value}" for key, value in TINY_SIZES.items()),
                 f"method_args.moe_adapters.{option}={value}", f"output_dir={tmp_path / 'run'}"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "run").exists()
    assert len(error) == 1 and error[0].startswith("hf-ccl: error: method_args.moe_adapters: ")
    assert "more than the 1,617,889 of the model they adapt" in error[0] and "lower num_experts or bottleneck" in error[0]


def test_the_size_bound_is_the_models_own_parameter_count():
    """Adapters of E experts of bottleneck 8 on a hidden-32 CLIP with one layer per tower add, by hand,
    2 layers x E x (2 x 32 x 8 + 8 + 32 + 2 x 32 router and noise weights) + one DDAS autoencoder
    (2 x 32 x 100 + 32 + 100): at most the model's 1,617,889 parameters. The defaults pass; on the Python path
    the task start refuses before installing anything."""
    from hf_ccl.methods.sizes import model_skeleton

    skeleton = model_skeleton({"config": TINY_SIZES})
    base = sum(p.numel() for p in skeleton.parameters())
    assert base == 1_617_889
    _method(num_experts=22, bottleneck=64, ddas_code_dim=100).check_model(skeleton)
    largest = (base - (2 * 32 * 100 + 32 + 100)) // (2 * (2 * 32 * 8 + 8 + 32 + 2 * 32))
    _method(num_experts=largest, bottleneck=8, ddas_code_dim=100).check_model(skeleton)
    with pytest.raises(ConfigError, match="more than the 1,617,889") as caught:
        _method(num_experts=largest + 1, bottleneck=8, ddas_code_dim=100).check_model(skeleton)
    assert caught.value.key == "method_args.moe_adapters.num_experts"
    model = tiny_model("clip")
    with pytest.raises(ConfigError, match="more than"):
        _method(num_experts=10**6).on_task_start(_context(model))
    assert moe_bank(model) is None
