"""Modality-pair streams (CMCL): heads, folding into CLIP, DNS on heads, the learner's checkpoints and errors."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import CLIPModel

from hf_ccl.pairs.builders import flickr_fashion_pairs
from hf_ccl.pairs.encoders import CallableEncoder, PrecomputedEncoder, clip_encoders
from hf_ccl.pairs.evaluate import alignment_matrix
from hf_ccl.pairs.features import encode_task
from hf_ccl.pairs.heads import LearnerHeads, fold_into_clip
from hf_ccl.pairs.learner import PairStreamArguments, PairStreamLearner
from hf_ccl.pairs.methods import build_pair_methods
from hf_ccl.pairs.methods.base import PairTaskContext
from hf_ccl.pairs.methods.dns import PairDNS
from hf_ccl.pairs.objective import PairObjective
from hf_ccl.pairs.task import PairStream, PairTask


@pytest.fixture(scope="module")
def small_stream(shared_data_root):
    return flickr_fashion_pairs(shared_data_root, train_per_task=64, test_per_task=32, seed=0)


def _vector_task(name, a, b, xa, xb):
    rows = {a: xa.tolist(), b: xb.tolist()}
    return PairTask(name, a, b, train=Dataset.from_dict(rows), test=Dataset.from_dict(rows))


def _context(task, heads, xa, xb, index=0):
    return PairTaskContext(index, task, PairStream([task]), heads, xa, xb, PairObjective())


# ----- heads, loss, recall -------------------------------------------------------------------------------------------
def test_heads_start_as_identity_and_only_the_pair_trains():
    heads = LearnerHeads(6, ["image", "en", "de"])
    x = torch.randn(5, 6)
    assert torch.equal(heads("de", x), x)
    heads.train_only(["image", "en"])
    assert [n for n, p in heads.named_parameters() if p.requires_grad] == [
        "heads.image.weight",
        "heads.en.weight",
    ]
    with pytest.raises(KeyError, match="no learner head"):
        heads("fr", x)
    with pytest.raises(ValueError, match="dim 4"):
        heads("en", torch.randn(2, 4))


def test_fold_into_clip_gives_the_heads_directions(
    tiny_model, image_processor, clip_tokenizer, small_stream, tmp_path
):
    encoders = clip_encoders(tiny_model, image_processor, clip_tokenizer)
    task = small_stream[0]
    heads = LearnerHeads(tiny_model.config.projection_dim, ["image", "en"])
    torch.manual_seed(0)
    with torch.no_grad():
        for head in heads.heads.values():
            head.weight.add_(0.3 * torch.randn_like(head.weight))
    folded = fold_into_clip(tiny_model, heads, "image", "en")
    folded.save_pretrained(tmp_path)
    plain = CLIPModel.from_pretrained(tmp_path).eval()
    features = encode_task(task, encoders)
    images = task.test["image"][:8]
    pixel_values = image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        image_embeds = plain.get_image_features(pixel_values=pixel_values)
        image_embeds = getattr(image_embeds, "pooler_output", image_embeds)
        tokens = clip_tokenizer(task.test["en"][:8], padding=True, return_tensors="pt")
        text_embeds = plain.get_text_features(**tokens)
        text_embeds = getattr(text_embeds, "pooler_output", text_embeds)
    unit = torch.nn.functional.normalize
    expected_images = unit(heads("image", features.test_a[:8]), dim=-1)
    expected_texts = unit(heads("en", features.test_b[:8]), dim=-1)
    assert torch.allclose(unit(image_embeds, dim=-1), expected_images, atol=1e-5)
    assert torch.allclose(unit(text_embeds, dim=-1), expected_texts, atol=1e-5)
    assert not torch.equal(tiny_model.visual_projection.weight, folded.visual_projection.weight)  # a copy
    with pytest.raises(ValueError, match="bias"):
        fold_into_clip(tiny_model, LearnerHeads(heads.dim, ["image", "en"], bias=True), "image", "en")


# ----- DNS on heads -------------------------------------------------------------------------------------------------
def _low_rank(n, d, rank, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, rank, generator=generator) @ torch.randn(rank, d, generator=generator)


def _learn_first_task(method, heads, task, xa, xb):
    heads.train_only(task.modalities)
    context = _context(task, heads, xa, xb)
    method.on_task_start(context)
    optimizer = torch.optim.SGD([p for p in heads.parameters() if p.requires_grad], lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        context.objective(heads, task.modality_a, task.modality_b, xa, xb).backward()
        method.pre_optimizer_step(heads, context)
        optimizer.step()
    method.on_task_end(context)


def _one_projected_sgd_step(method, heads, task, xa, xb, lr):
    heads.train_only(task.modalities)
    context = _context(task, heads, xa, xb, index=1)
    if method is not None:
        method.on_task_start(context)
    heads.zero_grad()
    context.objective(heads, task.modality_a, task.modality_b, xa, xb).backward()
    if method is not None:
        method.pre_optimizer_step(heads, context)
    with torch.no_grad():
        for p in heads.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad)


@pytest.mark.parametrize("second_pair", [("a", "b"), ("a", "c")])
def test_dns_moves_old_alignments_only_at_second_order(second_pair):
    """Thm. 4/5: after a projected SGD step of size η the old alignment matrix moves O(η²) (exactly 0 when only one
    of the old pair's heads moves); an unprojected step moves it O(η)."""
    d = 8
    xa, xb = _low_rank(40, d, 3, 0), _low_rank(40, d, 3, 1)
    first = _vector_task("t0", "a", "b", xa, xb)
    new_a, new_other = torch.randn(40, d), torch.randn(40, d)
    second = _vector_task("t1", *second_pair, new_a, new_other)
    drifts = {}
    for name in ("dns", "vanilla"):
        for lr in (1e-2, 5e-3):
            torch.manual_seed(0)
            heads = LearnerHeads(d, ["a", "b", "c"])
            method = PairDNS({"threshold_in": 1e-9, "threshold_out": 1e-9})
            _learn_first_task(method, heads, first, xa, xb)
            before = alignment_matrix(heads, "a", "b", xa, xb)
            _one_projected_sgd_step(method if name == "dns" else None, heads, second, new_a, new_other, lr)
            drifts[name, lr] = float(
                (alignment_matrix(heads, "a", "b", xa, xb) - before).norm() / before.norm()
            )
    assert drifts["vanilla", 1e-2] / drifts["vanilla", 5e-3] == pytest.approx(2.0, rel=0.05)  # first order
    assert drifts["dns", 1e-2] < 1e-3 * drifts["vanilla", 1e-2]
    if second_pair == ("a", "c"):
        assert drifts["dns", 1e-2] < 1e-6  # W_b does not move: no η² cross term (float32 round-off only)
    else:
        assert drifts["dns", 1e-2] / drifts["dns", 5e-3] == pytest.approx(4.0, rel=0.05)  # second order


def test_dns_with_nothing_above_threshold_is_plain_training():
    """A threshold above every eigenvalue keeps no direction: ΔW = G, the same step as vanilla."""
    d = 6
    xa, xb = torch.randn(30, d), torch.randn(30, d)
    task = _vector_task("t0", "a", "b", xa, xb)
    results = []
    for method in (PairDNS({"threshold_in": 1e6, "threshold_out": 1e6}), None):
        torch.manual_seed(0)
        heads = LearnerHeads(d, ["a", "b"])
        if method is not None:
            _learn_first_task(method, heads, task, xa, xb)
        else:
            _learn_first_task(PairDNS({"threshold_in": 1e6}), heads, task, xa, xb)
        _one_projected_sgd_step(method, heads, task, xb, xa, 0.1)
        results.append({k: v.clone() for k, v in heads.state_dict().items()})
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key])


def test_dns_covariances_follow_alg1_and_the_official_preset():
    d = 4
    xa, xb = torch.randn(10, d), torch.randn(10, d)
    heads = LearnerHeads(d, ["a", "b"])
    with torch.no_grad():
        heads.heads["b"].weight.mul_(2.0)
    task = _vector_task("t0", "a", "b", xa, xb)
    method = PairDNS()
    method.on_task_end(_context(task, heads, xa, xb))
    a_state = method.covariances["a"]
    assert torch.allclose(a_state["in"], xa.double().T @ xa.double() / 10)
    assert torch.allclose(a_state["out"], 4 * xb.double().T @ xb.double() / 10)  # the PARTNER's outputs (A2)
    more = torch.randn(30, d)
    method.on_task_end(
        _context(_vector_task("t1", "a", "c", more, more), heads.__class__(d, ["a", "c"]), more, more)
    )
    stacked = torch.cat([xa, more]).double()
    assert torch.allclose(method.covariances["a"]["in"], stacked.T @ stacked / 40)  # running mean (Thm. 8)
    assert method.counts["a"]["in"] == 40 and method.counts["b"]["in"] == 10
    official = PairDNS({"preset": "official"})
    assert official.config.threshold_out == 0.0 and official.config.counts == "global"
    official.on_task_end(_context(task, heads, xa, xb))
    official.on_task_end(
        _context(_vector_task("t1", "a", "c", more, more), LearnerHeads(d, ["a", "c"]), more, more)
    )
    # one global n̄ (A5): c, new in task 2, is normalised by all 40 rows seen so far, not by its own 30
    assert torch.allclose(official.covariances["c"]["in"], more.double().T @ more.double() / 40)
    assert torch.allclose(method.covariances["c"]["in"], more.double().T @ more.double() / 30)


# ----- the learner --------------------------------------------------------------------------------------------------
def _args(tmp_path, **overrides):
    values = {
        "output_dir": str(tmp_path),
        "epochs": 2,
        "batch_size": 16,
        "learning_rate": 1e-2,
        "logging_steps": 50,
    }
    values.update(overrides)
    return PairStreamArguments(**values)


def test_learner_runs_dns_saves_plain_clip_and_resumes_exactly(
    tiny_model, image_processor, clip_tokenizer, small_stream, tmp_path
):
    encoders = clip_encoders(tiny_model, image_processor, clip_tokenizer)
    stream = PairStream(small_stream.tasks[:3])
    dns_args = {"dns": {"project": "update"}}  # exact at first order under AdamW (spec A7)
    full = PairStreamLearner(
        stream, encoders, _args(tmp_path / "full"), methods="dns", method_args=dns_args, clip=tiny_model
    )
    matrix = full.run()
    assert [row.label for row in matrix.rows] == stream.task_names and matrix.initial is not None
    last = tmp_path / "full" / "task-2"
    assert CLIPModel.from_pretrained(last).config.projection_dim == tiny_model.config.projection_dim
    state = json.loads((last / "pair_stream.json").read_text())
    assert state["pairs"] == [["image", "en"], ["en", "de"], ["image", "de"]]
    assert len(state["timings"]) == 3 and state["timings"][0]["steps"] == 8  # 2 epochs x 64/16
    # each earlier task's train alignment drift is recorded; DNS keeps it well below plain fine-tuning's
    vanilla = PairStreamLearner(
        stream, encoders, _args(tmp_path / "vanilla"), methods="vanilla", clip=tiny_model
    )
    vanilla_matrix = vanilla.run()
    for name in stream.task_names[:2]:
        dns_drift = matrix.rows[-1].metrics[name]["drift"]
        assert 0 <= dns_drift < 0.5 * vanilla_matrix.rows[-1].metrics[name]["drift"], name
    assert set(full.methods[0].covariances) == {"image", "en", "de"}

    # interrupted after task 1: resume from task-1 and finish identically
    partial_dir = tmp_path / "partial"
    interrupted = PairStreamLearner(
        PairStream(stream.tasks[:2]),
        encoders,
        _args(partial_dir),
        methods="dns",
        method_args=dns_args,
        clip=tiny_model,
    )
    interrupted.run()
    resumed = PairStreamLearner(
        stream, encoders, _args(partial_dir), methods="dns", method_args=dns_args, clip=tiny_model
    )
    resumed.run()
    for key, value in full.heads.state_dict().items():
        assert torch.allclose(value, resumed.heads.state_dict()[key], atol=1e-6), key
    for modality, stored in full.methods[0].covariances.items():
        for side in ("in", "out"):
            assert torch.allclose(stored[side], resumed.methods[0].covariances[modality][side], atol=1e-9)
    assert resumed.matrix.rows[-1].to_dict() == full.matrix.rows[-1].to_dict()
    assert [row.label for row in resumed.matrix.rows] == stream.task_names


def test_any_encoder_plugs_in(tmp_path):
    """A third modality from a callable encoder (a stand-in for an audio model) trains beside precomputed vectors."""
    generator = torch.Generator().manual_seed(0)
    raw_audio = torch.randn(48, 10, generator=generator)
    text = raw_audio[:, :6] + 0.1 * torch.randn(48, 6, generator=generator)
    mixing = torch.randn(10, 6, generator=generator)
    rows = {"audio": raw_audio.tolist(), "en": text.tolist()}
    task = PairTask("audio-en", "audio", "en", Dataset.from_dict(rows), Dataset.from_dict(rows))
    encoders = {
        "audio": CallableEncoder(lambda batch: torch.tensor(batch) @ mixing, dim=6),
        "en": PrecomputedEncoder(dim=6, normalize=True),
    }
    learner = PairStreamLearner(
        PairStream([task]), encoders, _args(tmp_path, epochs=20, learning_rate=5e-2), methods=["dns"]
    )
    matrix = learner.run()
    assert matrix.rows[0].metrics["audio-en"]["R@1"] > matrix.initial.metrics["audio-en"]["R@1"]
    assert not (tmp_path / "task-0" / "config.json").exists()  # no CLIP given: heads only


def test_bad_input_fails_before_training(tiny_model, image_processor, clip_tokenizer, small_stream, tmp_path):
    encoders = clip_encoders(tiny_model, image_processor, clip_tokenizer)
    with pytest.raises(ValueError, match="Unknown pair method"):
        build_pair_methods(["dns", "gemm"])
    with pytest.raises(ValueError, match="valid options"):
        build_pair_methods(["dns"], {"dns": {"lambda": 1}})
    with pytest.raises(ValueError, match="no encoder for modality"):
        PairStreamLearner(small_stream, {"image": encoders["image"]}, _args(tmp_path))
    with pytest.raises(ValueError, match="with itself"):
        PairTask("x", "en", "en", small_stream[1].train, small_stream[1].test)
    with pytest.raises(ValueError, match="empty train"):
        PairTask("x", "en", "de", small_stream[1].train.select([]), small_stream[1].test)
    with pytest.raises(ValueError, match="lacks column"):
        PairTask("x", "en", "fr", small_stream[1].train, small_stream[1].test)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        PairStreamLearner(small_stream, encoders, _args(tmp_path, batch_size=128)).training_arguments(0)
    with pytest.raises(ValueError, match="fold modality"):
        PairStreamLearner(small_stream, encoders, _args(tmp_path, fold_text_modality="fr"), clip=tiny_model)
    with pytest.raises(ValueError, match="features for 1 tasks"):
        PairStreamLearner(
            small_stream, encoders, _args(tmp_path), features=[encode_task(small_stream[0], encoders)]
        )
    shorter = PairTask("short", "en", "de", small_stream[1].train.select(range(40)), small_stream[1].test)
    with pytest.raises(ValueError, match="do not match its splits"):
        PairStreamLearner(
            PairStream([shorter]),
            encoders,
            _args(tmp_path),
            features=[encode_task(small_stream[1], encoders)],
        )
    with pytest.raises(ValueError, match="flickr8k pairs"):
        flickr_fashion_pairs(tmp_path, [("flickr8k", "image", "klingon")])
    with pytest.raises(ValueError, match="dns variant"):
        PairDNS({"variant": "three_sided"})


def test_every_task_is_pushed_as_a_plain_clip_revision(
    tiny_model, image_processor, clip_tokenizer, small_stream, tmp_path, local_hub
):
    from huggingface_hub import HfApi

    repo = "hf-ccl-test/clip-pairs"
    encoders = clip_encoders(tiny_model, image_processor, clip_tokenizer)
    stream = PairStream(small_stream.tasks[:2])
    learner = PairStreamLearner(
        stream, encoders, _args(tmp_path, hub_model_id=repo), methods=["dns", "ewc"], clip=tiny_model
    )
    learner.run()
    assert learner.push_report is not None and not learner.push_report.failed
    for k in range(2):
        remote = CLIPModel.from_pretrained(repo, revision=f"task-{k}")
        local = CLIPModel.from_pretrained(tmp_path / f"task-{k}")
        assert torch.equal(remote.visual_projection.weight, local.visual_projection.weight)
        files = set(HfApi().list_repo_files(repo, revision=f"task-{k}"))
        assert {
            "learner_heads.safetensors",
            "pair_stream.json",
            "hf_ccl/method_state.json",
            "README.md",
        } <= files
    first = CLIPModel.from_pretrained(repo, revision="task-0").text_projection.weight
    assert not torch.equal(first, CLIPModel.from_pretrained(repo, revision="task-1").text_projection.weight)
