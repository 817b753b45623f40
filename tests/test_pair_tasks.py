"""Pair tasks in the one loop (CMCL's setting): learner heads as a model change, cached features as a data
transform, Recall@K and drift in the evaluator, checkpoints that are plain CLIPs, exact resume, and refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import CLIPModel, CLIPProcessor, pipeline

from hf_ccl.callbacks import TaskCallback
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import Task, TaskStream, build_stream, load_image_processor
from hf_ccl.evaluation.pairs import diagonal_rank_counts, pair_recall
from hf_ccl.heads import LearnerHeads, pair_contrastive_loss
from hf_ccl.methods import build_methods
from hf_ccl.pair_features import CallableEncoder, PrecomputedEncoder, encode_pair_stream, pair_encoders
from hf_ccl.testing import StopAfterTask, TrainingLogRecorder, tiny_clip
from hf_ccl.validation import ConfigError

TRAINING = {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-2, "logging_steps": 1}


def _learner(stream, tmp_path, methods=("learner_heads",), options=None, clip_tokenizer=None, **args):
    arguments = ContinualArguments(output_dir=str(tmp_path), training=dict(TRAINING), progress=False, **args)
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods(list(methods), options or {}),
                            load_image_processor(32), clip_tokenizer, arguments)


# ----- heads, loss, recall -------------------------------------------------------------------------------------------
def test_heads_start_as_identity_and_only_the_pair_trains():
    heads = LearnerHeads(6, ["image", "en", "de"])
    x = torch.randn(5, 6)
    assert torch.equal(heads.head_output("de", x), x)
    heads.train_only(["image", "en"])
    assert [n for n, p in heads.named_parameters() if p.requires_grad] == ["heads.image.weight", "heads.en.weight"]
    with pytest.raises(KeyError, match="no learner head"):
        heads.head_output("fr", x)
    with pytest.raises(ValueError, match="dim 4"):
        heads.head_output("en", torch.randn(2, 4))
    with pytest.raises(ValueError, match="bias"):
        LearnerHeads(6, bias=True)  # cannot be folded; fold=None keeps them


def test_eq2_loss_and_recall_by_hand():
    logits = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    expected = -(np.log(np.exp(2) / (np.exp(2) + 1)) + np.log(0.5)) / 2  # one direction, anchor = rows
    assert pair_contrastive_loss(logits).item() == pytest.approx(expected, abs=1e-6)
    both = (expected + -(np.log(np.exp(2) / (np.exp(2) + np.exp(1))) + np.log(np.exp(1) / (1 + np.exp(1)))) / 2) / 2
    assert pair_contrastive_loss(logits, symmetric=True).item() == pytest.approx(both, abs=1e-6)
    scores = torch.tensor([[3.0, 1.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    counts = diagonal_rank_counts(scores)
    assert counts.above.tolist() == [0, 1, 0] and counts.tied_negatives.tolist() == [0, 0, 0]
    metrics = pair_recall(scores, ks=(1,))
    assert metrics["a2b_R@1"] == pytest.approx(200 / 3)
    # Column 1 ties 1 = 1 with column 0's entry: in a random order of the tie it comes first half the time.
    assert metrics["b2a_R@1"] == pytest.approx((1 + 0.5 + 1) / 3 * 100)


# ----- the loop ------------------------------------------------------------------------------------------------------
def test_pair_stream_trains_heads_only_and_saves_plain_clips(pair_stream, clip_tokenizer, tmp_path):
    learner = _learner(pair_stream, tmp_path / "run", clip_tokenizer=clip_tokenizer)
    start = {name: p.detach().clone() for name, p in learner.model.named_parameters()}

    matrix = learner.fit()
    assert [row.label for row in matrix.rows] == pair_stream.task_names and matrix.initial is not None
    heads = learner.model.learner_heads
    method = learner.methods[0]
    snapshots = heads.snapshots
    assert list(snapshots) == pair_stream.task_names
    # task k moved exactly its two heads: compare the snapshots after consecutive tasks
    previous = {name: torch.eye(heads.dim) for name in ("image", "en", "de")}
    for task in pair_stream:
        after = {m: snapshots[task.name][f"heads.{m}.weight"] for m in previous}
        moved = {m for m in previous if not torch.equal(after[m], previous[m])}
        assert moved == set(task.modalities), task.name
        previous = after
    # the CLIP itself never trained: every parameter as it started (the projections held unfolded)
    for name, param in learner.model.named_parameters():
        if not name.startswith("learner_heads."):
            assert torch.equal(param, start[name]), name
    # drift of each earlier task, nothing for the task just trained
    last = matrix.rows[-1].metrics
    assert "drift" in last["flickr-image-en"] and "drift" in last["flickr-en-de"]
    assert "drift" not in last["flickr-image-de"] and "drift" not in matrix.rows[0].metrics["flickr-image-en"]
    # the checkpoint is a plain CLIP with its processor, the image and en heads folded into the projections
    folder = tmp_path / "run" / "task-2"
    plain = CLIPModel.from_pretrained(folder).eval()
    base = method.base_projections
    assert torch.allclose(plain.visual_projection.weight, heads.heads["image"].weight.detach() @ base["visual_projection"])
    assert torch.allclose(plain.text_projection.weight, heads.heads["en"].weight.detach() @ base["text_projection"])
    processor = CLIPProcessor.from_pretrained(folder)
    task = pair_stream[0]
    images, texts = task.eval["image"][:6], task.eval["en"][:6]
    inputs = processor(images=[_pil(i) for i in images], text=texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = plain(**inputs)
    eval_rows = learner.stream[0].eval.with_format("torch")[:6]
    z = heads("image", "en", eval_rows["features_a"], eval_rows["features_b"], return_loss=False)
    unit = torch.nn.functional.normalize
    assert torch.allclose(out.image_embeds, unit(z.z_a, dim=-1), atol=1e-5)
    assert torch.allclose(out.text_embeds, unit(z.z_b, dim=-1), atol=1e-5)
    classifier = pipeline("zero-shot-image-classification", model=str(folder))
    assert len(classifier(_pil(images[0]), candidate_labels=["a dog", "a cat"])) == 2


def _pil(cell):
    from hf_ccl.data.images import decode_image

    return decode_image(cell, "test")


def test_resume_after_a_task_finishes_identically(pair_stream, clip_tokenizer, tmp_path):
    options = {"learner_heads": {"similarity": "cosine"}}
    full = _learner(pair_stream, tmp_path / "full", options=options, clip_tokenizer=clip_tokenizer)
    full.fit()
    first = _learner(pair_stream, tmp_path / "cut", options=options, clip_tokenizer=clip_tokenizer)
    first.task_callbacks.add([StopAfterTask(1)])
    first.fit()
    assert len(first.results.rows) == 2
    resumed = _learner(pair_stream, tmp_path / "cut", options=options, clip_tokenizer=clip_tokenizer,
                       resume_from_checkpoint=True)
    resumed.fit()
    for name, value in full.model.learner_heads.state_dict().items():
        assert torch.allclose(value, resumed.model.learner_heads.state_dict()[name], atol=1e-6), name
    assert resumed.results.rows[-1].to_dict() == full.results.rows[-1].to_dict()
    saved = CLIPModel.from_pretrained(tmp_path / "cut" / "task-2").state_dict()
    for name, value in CLIPModel.from_pretrained(tmp_path / "full" / "task-2").state_dict().items():
        assert torch.allclose(value, saved[name], atol=1e-6), name


def test_any_encoder_plugs_in(tmp_path, clip_tokenizer):
    """A modality from a callable encoder (a stand-in for an audio model) aligns with precomputed vectors."""
    generator = torch.Generator().manual_seed(0)
    dim = tiny_clip().config.projection_dim
    raw_audio = torch.randn(64, 10, generator=generator)
    mixing = torch.randn(10, dim, generator=generator)
    rotation, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
    audio_features = torch.nn.functional.normalize(raw_audio @ mixing, dim=-1)
    vectors = audio_features @ rotation + 0.01 * torch.randn(64, dim, generator=generator)  # a rotation to learn
    rows = {"audio": raw_audio.tolist(), "vec": vectors.tolist()}
    task = Task("audio-vec", Dataset.from_dict(rows), Dataset.from_dict(rows), kind="pair", modalities=("audio", "vec"))
    arguments = ContinualArguments(output_dir=str(tmp_path), progress=False, pairs={"precomputed_modalities": ["vec"]},
                                   training={**TRAINING, "max_steps": 30, "learning_rate": 5e-2})
    options = {"learner_heads": {"fold_image_modality": None, "fold_text_modality": None, "temperature": 0.1}}
    learner = ContinualLearner(
        tiny_clip(), TaskStream("audio", [task]), build_methods(["learner_heads"], options), load_image_processor(32),
        clip_tokenizer, arguments,
        modality_encoders={"audio": CallableEncoder(lambda batch: torch.tensor(batch) @ mixing, dim=dim)},
    )
    matrix = learner.fit()
    before, after = matrix.initial.metrics["audio-vec"]["R@1"], matrix.rows[0].metrics["audio-vec"]["R@1"]
    assert before < 20 and after > before + 30, (before, after)
    # fold: null, the saved CLIP is the frozen prior (the heads are in the method state)
    assert torch.equal(CLIPModel.from_pretrained(tmp_path / "task-0").visual_projection.weight,
                       tiny_clip().visual_projection.weight)


def test_encoders_check_their_features(pair_stream, clip_tokenizer):
    model = tiny_clip()
    with pytest.raises(ValueError, match="8-d features"):
        pair_encoders(model, load_image_processor(32), clip_tokenizer, ["image", "en"], given={"en": PrecomputedEncoder(8)})
    with pytest.raises(ValueError, match="no encoder for modality"):
        encode_pair_stream(pair_stream, {"image": PrecomputedEncoder(32)})


def test_bad_combinations_fail_before_training(pair_stream, clip_tokenizer, tmp_path, shared_data_root):
    with pytest.raises(ConfigError, match="add the learner_heads method"):
        _learner(pair_stream, tmp_path, methods=("finetune",), clip_tokenizer=clip_tokenizer)
    with pytest.raises(ValueError, match="parameter_efficient|freezes"):
        _learner(pair_stream, tmp_path, methods=("learner_heads", "lora"), clip_tokenizer=clip_tokenizer)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        ContinualLearner(tiny_clip(), pair_stream, build_methods(["learner_heads"]), load_image_processor(32),
                         clip_tokenizer, ContinualArguments(output_dir=str(tmp_path), progress=False, training={
                             **TRAINING, "gradient_accumulation_steps": 2}))
    with pytest.raises(ValueError, match="fold modality"):
        _learner(pair_stream, tmp_path, options={"learner_heads": {"fold_text_modality": "fr"}},
                 clip_tokenizer=clip_tokenizer)
    with pytest.raises(ValueError, match="bias"):
        build_methods(["learner_heads"], {"learner_heads": {"bias": True}})
    digits = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    mixed = TaskStream("mixed", [digits[0], pair_stream[0]])
    with pytest.raises(ValueError, match="pair tasks .*only"):
        _learner(mixed, tmp_path, clip_tokenizer=clip_tokenizer)
    with pytest.raises(ValueError, match="with itself"):
        Task("x", pair_stream[1].train, pair_stream[1].eval, kind="pair", modalities=("en", "en"))
    with pytest.raises(ValueError, match="names its two modalities"):
        Task("x", pair_stream[1].train, pair_stream[1].eval, kind="pair")
    with pytest.raises(ValueError, match="missing column"):
        _learner(TaskStream("x", [Task("x", pair_stream[1].train, pair_stream[1].eval, kind="pair",
                                       modalities=("en", "fr"))]), tmp_path, clip_tokenizer=clip_tokenizer)
    with pytest.raises(ValueError, match="validate_images"):
        build_stream("flickr-fashion-pairs", validate_images=True)


def test_the_pair_recipe_runs_from_the_command_line(tmp_path, capsys):
    """recipes/configs/cmcl-pairs.yaml through `hf-ccl train` (what `accelerate launch recipes/train.py` runs), on a
    tiny random CLIP, with the recipe's methods (learner_heads, dns): every task folder is a plain CLIP with its
    processor, and DNS's covariances are in its method state."""
    from hf_ccl.cli import main

    overrides = [
        f"output_dir={tmp_path}", "progress=false", "training.max_steps=2", "training.per_device_train_batch_size=16",
        "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=16", "model.pretrained=null",
        "model.config={hidden_size: 32, num_layers: 1, num_heads: 2, image_size: 32, patch_size: 8, projection_dim: 32}",
    ]
    assert main(["train", "--config", "cmcl-pairs", *overrides]) == 0
    assert "| after fashion-image-en |" in capsys.readouterr().out
    folder = tmp_path / "task-3"
    assert CLIPModel.from_pretrained(folder).config.projection_dim == 32
    assert CLIPProcessor.from_pretrained(folder).tokenizer is not None
    state = json.loads((folder / "method_state.json").read_text())
    assert sorted(state) == ["dns", "learner_heads"] and state["dns"]["state"]["covariances"]


def test_encoder_settings_are_checked():
    with pytest.raises(ConfigError, match="one encoder"):
        ContinualArguments(output_dir="x", pairs={"image_modalities": ["image"], "precomputed_modalities": ["image"]})
    with pytest.raises(ConfigError, match="modality names"):
        ContinualArguments(output_dir="x", pairs={"image_modalities": [""]})


@pytest.mark.parametrize("method", ["er", "lwf", "modx", "ctp"])
def test_methods_not_made_for_pair_tasks_are_refused(pair_stream, clip_tokenizer, tmp_path, method):
    """ER would mix one pair's feature rows into another pair's batches: refused, naming what works."""
    with pytest.raises(ConfigError, match=rf"\['{method}'\] do not train pair tasks.*learner_heads"):
        _learner(pair_stream, tmp_path, methods=("learner_heads", method), clip_tokenizer=clip_tokenizer)


def test_ewc_on_heads_is_the_fisher_of_the_pair_loss(pair_stream, clip_tokenizer, tmp_path):
    """After task 0 (image-en) online EWC's F is g² of the Eq. 2 loss over the whole task (one Fisher batch), for
    the two heads that trained and nothing else; task 1 (en-de) is pulled towards task 0's en head."""
    seen = {}

    class FisherByHand(TaskCallback):
        def on_task_end(self, args, state, control, **kwargs):
            if state.task_index == 0:
                model, task = kwargs["context"].model, kwargs["context"].task
                rows = task.train.with_format("torch")[:]
                heads = [model.learner_heads.heads[m].weight for m in task.modalities]
                loss = model(features_a=rows["features_a"], features_b=rows["features_b"], modality_a="image",
                             modality_b="en", return_loss=True).loss
                seen["by_hand"] = [g.pow(2) for g in torch.autograd.grad(loss, heads)]
                seen["fisher"] = {k: v.clone() for k, v in learner.methods[1].penalty.importance.items()}

    options = {"ewc": {"fisher_batch_size": 64}}
    learner = _learner(pair_stream, tmp_path, methods=("learner_heads", "ewc"), options=options,
                       clip_tokenizer=clip_tokenizer)
    learner.task_callbacks.add([FisherByHand()])
    recorder = TrainingLogRecorder()
    learner.task_callbacks.add([recorder])
    learner.fit()
    fisher = seen["fisher"]
    assert sorted(fisher) == ["learner_heads.heads.en.weight", "learner_heads.heads.image.weight"]
    torch.testing.assert_close(fisher["learner_heads.heads.image.weight"], seen["by_hand"][0], rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(fisher["learner_heads.heads.en.weight"], seen["by_hand"][1], rtol=1e-4, atol=1e-12)
    penalties = [log["loss/ewc/penalty"] for log in recorder.step_logs(1)]
    assert penalties[0] == 0.0 and max(penalties) > 0.0


@pytest.mark.parametrize("method", ["si", "mas"])
def test_si_and_mas_on_heads_weigh_the_heads_that_trained(pair_stream, clip_tokenizer, tmp_path, method):
    options = {"mas": {"importance_batch_size": 8, "importance_max_batches": 2}} if method == "mas" else {}
    learner = _learner(TaskStream("two", pair_stream.tasks[:2]), tmp_path, methods=("learner_heads", method),
                       options=options, clip_tokenizer=clip_tokenizer)
    recorder = TrainingLogRecorder()
    learner.task_callbacks.add([recorder])
    learner.fit()
    importance = learner.methods[1].penalty.importance
    assert sorted(importance) == [f"learner_heads.heads.{m}.weight" for m in ("de", "en", "image")]
    assert all(float(value.abs().sum()) > 0 for value in importance.values())
    penalties = [log[f"loss/{method}/penalty"] for log in recorder.step_logs(1)]
    assert penalties[0] == 0.0 and max(penalties) > 0.0


def test_ewc_decays_only_the_heads_that_trained(pair_stream, clip_tokenizer, tmp_path):
    """CMCL's EWC baseline: at task 1 (en-de) F ← γF + F_t for en and de only; image did not train, so its F and θ*
    stay as task 0 left them (γ does not decay it), and `average` counts the tasks per head."""
    snapshots = []

    class KeepImportance(TaskCallback):
        def on_task_end(self, args, state, control, **kwargs):
            penalty = learner.methods[1].penalty
            snapshots.append(({k: v.clone() for k, v in penalty.importance.items()},
                              {k: v.clone() for k, v in penalty.anchor.items()}))

    options = {"ewc": {"gamma": 0.5, "fisher_batch_size": 32}}
    learner = _learner(TaskStream("two", pair_stream.tasks[:2]), tmp_path, methods=("learner_heads", "ewc"),
                       options=options, clip_tokenizer=clip_tokenizer)
    learner.task_callbacks.add([KeepImportance()])
    learner.fit()
    (first, first_anchor), (second, second_anchor) = snapshots
    image, en, de = (f"learner_heads.heads.{m}.weight" for m in ("image", "en", "de"))
    assert torch.equal(second[image], first[image]) and torch.equal(second_anchor[image], first_anchor[image])
    assert sorted(second) == sorted([image, en, de]) and not torch.equal(second[en], 0.5 * first[en])
    assert learner.methods[1].parameter_tasks == {image: 1, en: 2, de: 1}


def test_every_pair_task_is_pushed_as_a_plain_clip_revision(pair_stream, clip_tokenizer, tmp_path, local_hub):
    """The loop's Hub pushes (timeouts, retries, report) carry pair runs too: each task-<k> revision is the plain
    CLIP of its folder, with the method state and the model card."""
    from huggingface_hub import HfApi, ModelCard, hf_hub_download

    repo = "hf-ccl-test/clip-pairs"
    learner = _learner(TaskStream("two", pair_stream.tasks[:2]), tmp_path / "run", methods=("learner_heads", "dns"),
                       clip_tokenizer=clip_tokenizer, hub={"model_id": repo})
    learner.fit()
    assert learner.push_report is not None and not learner.push_report.failed
    for k in range(2):
        remote = CLIPModel.from_pretrained(repo, revision=f"task-{k}")
        local = CLIPModel.from_pretrained(tmp_path / "run" / f"task-{k}")
        assert torch.equal(remote.visual_projection.weight, local.visual_projection.weight)
        files = set(HfApi().list_repo_files(repo, revision=f"task-{k}"))
        assert {"model.safetensors", "method_state.json", "preprocessor_config.json", "README.md"} <= files
        card = ModelCard.load(hf_hub_download(repo, "README.md", revision=f"task-{k}"))
        assert "R@1" in card.text and "hf_ccl" in card.data.tags
    first = CLIPModel.from_pretrained(repo, revision="task-0").text_projection.weight
    assert not torch.equal(first, CLIPModel.from_pretrained(repo, revision="task-1").text_projection.weight)
