"""The `c_clip` method (C-CLIP, ICLR 2025): Eq. 5 by hand, the fold-in of Eq. 2, the projector's state, and a tiny
run of the shipped recipe through the CLI whose checkpoints a Python without hf_ccl loads."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import CLIPModel

from hf_ccl.cli import main
from hf_ccl.data import build_stream
from hf_ccl.methods import build_methods
from hf_ccl.methods.base import TaskContext
from hf_ccl.methods.c_clip import CCLIP, ckc_loss, instance_positive_mask, outside_encoder_parameters
from hf_ccl.methods.lora import adapter_name, lora_layers
from hf_ccl.testing import tiny_clip
from hf_ccl.validation import ConfigError

SMALL = {"r": 4, "alpha": 8.0, "projector_hidden_dim": 8}


# ----- Eq. 5 ---------------------------------------------------------------------------------------------------------
def test_ckc_loss_by_hand_on_a_2x2_batch():
    """N = 1: rows are the projected image and text, columns the old image and text (2N = 2). Projected features
    (2, 0) and (0, 3) normalise to e1, e2; old ones (1, 0) and (0.6, 0.8); with 1/tau = 2 the logits are
    S = 2 [[1, 0.6], [0, 0.8]]."""
    projected = torch.tensor([[2.0, 0.0], [0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[1.0, 0.0], [0.6, 0.8]])

    def ce(right: float, other: float) -> float:  # -log(e^right / (e^right + e^other))
        return math.log(math.exp(right) + math.exp(other)) - right

    forward = (ce(2.0, 1.2) + ce(1.6, 0.0)) / 2  # rows of S: projected -> old
    backward = (ce(2.0, 0.0) + ce(1.6, 1.2)) / 2  # rows of S^T: old -> projected
    paper = ckc_loss(projected, old, 2.0, reduction="sum")
    code = ckc_loss(projected, old, 2.0, reduction="mean")
    assert paper.item() == pytest.approx(forward + backward, abs=1e-6)  # Eq. 5 as printed: -1/(2N) sum of both
    assert code.item() == pytest.approx((forward + backward) / 2, abs=1e-6)
    paper.backward()
    assert projected.grad is not None and torch.isfinite(projected.grad).all() and projected.grad.abs().sum() > 0


def _authors_loss(p1, p2, z1, z2, scale):
    """The authors' code's loss, written from its description: rows p = norm([p1; p2]), columns z = norm([z1; z2]),
    logits shifted by their row max, positives the diagonal, every column in the denominator."""
    p, z = F.normalize(torch.cat([p1, p2]), dim=-1), F.normalize(torch.cat([z1, z2]), dim=-1)
    logits = p @ z.t() * scale
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    log_prob = logits - torch.log(torch.exp(logits).sum(dim=1, keepdim=True))
    return -log_prob.diagonal().mean()


def test_code_variant_equals_the_authors_loss_in_value_and_gradient():
    generator = torch.Generator().manual_seed(0)
    p1, p2, z1, z2 = (torch.randn(3, 5, generator=generator) for _ in range(4))
    scale = torch.tensor(4.0)
    ours_p = torch.cat([p1, p2]).requires_grad_(True)
    ours = ckc_loss(ours_p, torch.cat([z1, z2]), scale, reduction="mean")
    theirs_p1, theirs_p2 = p1.clone().requires_grad_(True), p2.clone().requires_grad_(True)
    theirs = (_authors_loss(theirs_p1, theirs_p2, z1, z2, scale) + _authors_loss(z1, z2, theirs_p1, theirs_p2, scale)) / 2
    torch.testing.assert_close(ours, theirs)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_p.grad, torch.cat([theirs_p1.grad, theirs_p2.grad]))


def test_repeated_items_are_positives_and_unique_ones_give_eq_5():
    """Images 0 and 1 are one image (twice in the batch); captions 1 and 2 are one caption. An image and a text are
    never positives. With unique items the mask is the identity, i.e. Eq. 5."""
    mask = instance_positive_mask(torch.tensor([7, 7, 8]), torch.tensor([1, 2, 2]))
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:2, :2] = True
    expected[2, 2] = True
    expected[3, 3] = True
    expected[4:, 4:] = True
    assert torch.equal(mask, expected)
    generator = torch.Generator().manual_seed(1)
    projected, old = torch.randn(6, 4, generator=generator), torch.randn(6, 4, generator=generator)
    unique = instance_positive_mask(torch.arange(3), torch.arange(3))
    torch.testing.assert_close(ckc_loss(projected, old, 3.0, unique), ckc_loss(projected, old, 3.0))
    assert not torch.allclose(ckc_loss(projected, old, 3.0, mask), ckc_loss(projected, old, 3.0))


def test_defaults_variants_and_refused_options():
    method = CCLIP()
    config = method.config
    assert (config.r, config.alpha, config.dropout, config.merge_alpha) == (16, 32.0, 0.1, 0.5)
    assert config.target_modules == ["out_proj", "fc1", "fc2"] and config.towers == ["text", "vision"]
    assert config.resolved("ckc_reduction") == "sum" and config.resolved("train_outside_encoders") is False
    code = CCLIP({"variant": "code"}).config
    assert code.resolved("ckc_reduction") == "mean" and code.resolved("train_outside_encoders") is True
    assert CCLIP({"variant": "code", "ckc_reduction": "sum"}).config.resolved("ckc_reduction") == "sum"
    for bad in ({"merge_alpha": 0.0}, {"merge_alpha": 1.5}, {"variant": "official"}, {"ckc_reduction": "avg"},
                {"ckc_weight": -1.0}, {"temperature": 0.0}, {"positives": "all"}, {"projector_hidden_dim": 0}):
        with pytest.raises(ConfigError, match="method_args.c_clip"):
            build_methods(["c_clip"], {"c_clip": bad})
    with pytest.raises(ConfigError, match="cannot be combined"):
        build_methods(["c_clip", "lora"])  # two adapters per task: each would freeze the other's
    with pytest.raises(ConfigError, match="Put 'c_clip' after 'grow_vocab'"):
        build_methods(["c_clip", "grow_vocab"])  # the old model must read the grown vocabulary
    assert [m.name for m in build_methods(["grow_vocab", "c_clip", "er"])] == ["grow_vocab", "c_clip", "er"]
    with pytest.raises(ConfigError, match=r"method_args\.c_clip\.r=16 exceeds the rank") as refused:
        CCLIP().check_model(tiny_clip(hidden_size=8, projection_dim=8, num_heads=2))
    assert refused.value.key == "method_args.c_clip.r"


# ----- Eq. 2 ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    return build_stream("digits", max_train_per_task=16, max_eval_per_task=8)


def _start(method: CCLIP, digits, tmp_path, model=None) -> TaskContext:
    torch.manual_seed(0)
    context = TaskContext(0, digits[0], digits, model or tiny_clip(num_layers=1), output_dir=tmp_path, seed=0)
    method.on_task_start(context)
    return context


def _embed(model, pixels, tokens):
    model.eval()
    with torch.no_grad():
        return model.embed_images(pixels, normalize=False), model.embed_texts(tokens, None, normalize=False)


def test_fold_in_at_alpha_equals_the_adapter_at_alpha_and_keeps_the_teacher(tmp_path, digits):
    """After the task, W = W_{t-1} + alpha (lora_alpha / r) B A (by hand, one layer) and the plain model computes
    what the adapted model computes with its LoRA scaled by alpha; the old model is the task-start model."""
    method = CCLIP(SMALL)
    initial = tiny_clip(num_layers=1)
    context = _start(method, digits, tmp_path, model=tiny_clip(num_layers=1))
    model = context.model
    assert method.teacher is not None
    for key, value in initial.state_dict().items():  # same seed: the teacher is the task-start model
        torch.testing.assert_close(dict(method.teacher.model.state_dict())[key], value, rtol=0, atol=0)
    layers = lora_layers(model)
    assert sorted({name.rsplit(".", 1)[1] for name in layers}) == ["fc1", "fc2", "out_proj"]
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    name, alpha = adapter_name(0), 0.5
    layer_name = "text_model.encoder.layers.0.mlp.fc1"
    layer = layers[layer_name]
    by_hand = (layer.get_base_layer().weight + alpha * (8.0 / 4) * layer.lora_B[name].weight
               @ layer.lora_A[name].weight).detach().clone()
    pixels, tokens = torch.randn(2, 3, 32, 32, generator=generator), torch.randint(0, 400, (2, 7), generator=generator)
    for adapted in layers.values():
        adapted.scaling[name] *= alpha
    expected = _embed(model, pixels, tokens)
    for adapted in layers.values():
        adapted.scaling[name] /= alpha
    assert "projector" in method.state_dict() and method.optimizer_parameters()
    method.after_training(context)
    assert not lora_layers(model)
    torch.testing.assert_close(model.get_submodule(layer_name).weight, by_hand, rtol=0, atol=1e-6)
    for got, want in zip(_embed(model, pixels, tokens), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    state = method.state_dict()
    assert "projector" not in state  # discarded after the task
    saved_b = state["adapters"]["0"][f"{layer_name}.lora_B.weight"]
    torch.testing.assert_close(saved_b, layer.lora_B[name].weight.detach(), rtol=0, atol=0)  # holds alpha B


def test_code_variant_trains_outside_the_encoders_and_folds_them_in_at_alpha(tmp_path, digits):
    method = CCLIP({**SMALL, "variant": "code", "ckc_weight": 0.0})
    context = _start(method, digits, tmp_path)
    model = context.model
    trainable = {name for name, p in model.named_parameters() if p.requires_grad and ".lora_" not in name}
    assert trainable == set(outside_encoder_parameters(model))
    assert "text_model.embeddings.token_embedding.weight" in trainable and "logit_scale" in trainable
    assert not any("encoder.layers" in n or "patch_embedding" in n for n in trainable)
    before = model.text_projection.weight.detach().clone()
    with torch.no_grad():
        model.text_projection.weight.add_(1.0)  # what training moved
    assert method.optimizer_parameters() == []  # ckc_weight 0: no projector
    method.after_training(context)
    torch.testing.assert_close(model.text_projection.weight, before + 0.5, rtol=0, atol=1e-6)


def test_projector_state_restores_in_place_mid_task(tmp_path, digits):
    """A mid-task checkpoint holds the projector; a resumed task's method restores it into the tensors its
    optimizer already holds. A task start re-initialises it (the same under the same seed)."""
    first = CCLIP(SMALL)
    _start(first, digits, tmp_path)
    with torch.no_grad():
        for param in first.optimizer_parameters():
            param.add_(1.0)  # trained
    state = first.state_dict()
    resumed = CCLIP(SMALL)
    _start(resumed, digits, tmp_path)
    held = resumed.optimizer_parameters()
    fresh = [p.detach().clone() for p in held]
    resumed.load_state_dict(state)
    assert [id(p) for p in resumed.optimizer_parameters()] == [id(p) for p in held]
    for got, want in zip(held, first.optimizer_parameters(), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(fresh, first.optimizer_parameters(), strict=True):
        assert torch.equal(got + 1.0, want)


# ----- the recipe through the CLI, and plain transformers -------------------------------------------------------------
TINY = ["model.config.hidden_size=32", "model.config.num_layers=1", "model.config.num_heads=2",
        "model.config.image_size=32", "model.config.projection_dim=32", "stream_args.n_tasks=2",
        "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=16", "first_task_epochs=null",
        "training.max_steps=3", "training.per_device_train_batch_size=16", "training.logging_steps=1",
        "evaluation.batch_size=64", "progress=false"]


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("c_clip")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", "--config", "c_clip-flickr8k-random5", f"output_dir={output}", *TINY]) == 0
    return output, printed.getvalue()


def test_recipe_runs_with_ckc_logged(recipe_run):
    output, printed = recipe_run
    assert len(json.loads((output / "results.json").read_text())["rows"]) == 2
    logged = [float(value) for value in re.findall(r"'loss/c_clip/ckc': '([0-9.]+)'", printed)]
    assert len(logged) == 6 and all(value > 0 for value in logged)  # 3 steps per task, from the first task on


PLAIN = r"""
import sys
import torch
from peft import PeftModel
from transformers import CLIPModel

assert "hf_ccl" not in sys.modules
run = sys.argv[1]
model, info = CLIPModel.from_pretrained(run + "/task-1", output_loading_info=True)
assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
assert not any("lora" in key for key in model.state_dict())
merged = PeftModel.from_pretrained(CLIPModel.from_pretrained(run + "/task-0"), run + "/adapters/task-1")
merged = merged.merge_and_unload().state_dict()
for key, value in model.state_dict().items():
    torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)
print("plain ok", "hf_ccl" in sys.modules)
"""


def test_the_saved_adapter_on_the_previous_checkpoint_gives_the_checkpoint(recipe_run):
    """PEFT's merge of `adapters/task-1` (which holds alpha B) on task 0 gives task 1: the fold-in of Eq. 2 is what
    a user reproduces from the saved adapter."""
    output = recipe_run[0]
    merged = PeftModel.from_pretrained(CLIPModel.from_pretrained(output / "task-0"), str(output / "adapters" / "task-1"))
    expected = merged.merge_and_unload().state_dict()
    for key, value in CLIPModel.from_pretrained(output / "task-1").state_dict().items():
        torch.testing.assert_close(expected[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow  # a fresh Python imports transformers and PEFT: about 12 s
def test_checkpoints_load_in_plain_transformers_and_equal_the_adapter_on_the_previous_one(recipe_run):
    """A Python that never imports hf_ccl loads task 1 with `CLIPModel.from_pretrained` (no missing or extra
    keys, no LoRA left) and rebuilds it with PEFT from task 0 and the saved adapter (which holds alpha B)."""
    result = subprocess.run([sys.executable, "-c", PLAIN, str(recipe_run[0])], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plain ok False" in result.stdout


@pytest.mark.slow  # two short runs with Trainer checkpoints: about 15 s
def test_resuming_mid_task_continues_the_adapter_and_the_projector(tmp_path):
    """A task resumed from the Trainer's mid-task checkpoint (the injected adapter in the model, the projector in
    the method state) ends with exactly the model of an uninterrupted run."""
    import shutil

    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import load_image_processor, load_tokenizer

    stream = build_stream("digits", max_train_per_task=64, max_eval_per_task=20)
    stream.tasks = stream.tasks[:2]
    training = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "save_strategy": "steps",
                "save_steps": 2}

    def fit(resume):
        args = ContinualArguments(output_dir=str(tmp_path), training=training, progress=False,
                                  evaluation={"batch_size": 64}, resume_from_checkpoint=resume,
                                  keep_trainer_checkpoints=True)
        methods = build_methods(["c_clip"], {"c_clip": {**SMALL, "dropout": 0.0}})
        learner = ContinualLearner(tiny_clip(), stream, methods, load_image_processor(32), load_tokenizer(), args)
        learner.fit()
        return learner.model.state_dict()

    weights = fit(None)
    shutil.rmtree(tmp_path / "task-1")  # stopped in task 1, after its Trainer checkpoint at step 2
    shutil.rmtree(tmp_path / "trainer" / "task-1" / "checkpoint-4")
    for key, value in fit(True).items():
        assert torch.equal(value, weights[key]), key
