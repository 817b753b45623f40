"""Mod-X §3 spatial-disorder diagnostics on hand-made 2-D embeddings, blockwise vs full, and on a real eval set."""

import json
import math

import pytest
import torch

from hf_ccl.data import build_stream
from hf_ccl.evaluation.spatial_disorder import (
    SAM_EDGES,
    angle_degrees,
    angle_histogram,
    bin_counts,
    bin_labels,
    embed_for_disorder,
    i2t_top1_correct,
    inter_modal_angle_variation,
    plot_spatial_disorder,
    rotation_angles,
    sam_change,
    sam_change_histogram,
    spatial_disorder,
    spatial_disorder_between,
)
from hf_ccl.testing import tiny_clip


def at(*degrees):
    """Unit vectors in the plane at the given angles (degrees)."""
    radians = [math.radians(d) for d in degrees]
    return torch.tensor([[math.cos(r), math.sin(r)] for r in radians], dtype=torch.float64)


def test_angles_bins_and_labels():
    assert float(angle_degrees(torch.tensor(0.5, dtype=torch.float64))) == pytest.approx(60.0)
    assert float(angle_degrees(torch.tensor(1.0 + 1e-7))) == 0.0  # clamped
    assert bin_labels(SAM_EDGES) == ["[0,5]", "(5,10]", "(10,15]", "(15,20]", "(20,180]"]
    # Bins are closed on the right: 5 falls in [0,5], 20 in (15,20].
    assert bin_counts(torch.tensor([0.0, 5.0, 5.5, 20.0, 20.5, 180.0]), SAM_EDGES).tolist() == [2, 1, 0, 1, 2]
    assert angle_histogram(torch.tensor([1.0, 7.0, 8.0, 90.0]), SAM_EDGES) == [25.0, 50.0, 0.0, 0.0, 25.0]
    assert all(math.isnan(v) for v in angle_histogram(torch.tensor([]), SAM_EDGES))


def test_sam_change_and_rotation_by_hand():
    before, after = at(0, 10, 30), at(0, 22, 30)
    # Pairs (0,1), (0,2), (1,2): angles 10, 30, 20 before and 22, 30, 8 after -> changes 12, 0, 12.
    assert sam_change(before, after).tolist() == pytest.approx([12.0, 0.0, 12.0])
    histogram, mean = sam_change_histogram(before, after)
    assert histogram == pytest.approx([100 / 3, 0.0, 200 / 3, 0.0, 0.0]) and mean == pytest.approx(8.0)
    assert rotation_angles(before, after).tolist() == pytest.approx([0.0, 12.0, 0.0])


def test_a_global_rotation_keeps_topology_but_rotates_every_sample():
    before = at(0, 10, 30, 100, 200)
    after = at(40, 50, 70, 140, 240)  # everything turned by 40 degrees
    histogram, mean = sam_change_histogram(before, after)
    assert histogram == pytest.approx([100.0, 0, 0, 0, 0]) and mean == pytest.approx(0.0, abs=1e-6)
    assert rotation_angles(before, after).tolist() == pytest.approx([40.0] * 5)


def test_blockwise_histogram_equals_the_full_one():
    torch.manual_seed(0)
    a, b = torch.randn(11, 6), torch.randn(11, 6)
    b = a + 0.3 * b
    full = sam_change(a, b)
    histogram, mean = sam_change_histogram(a, b, block_size=3)
    assert histogram == pytest.approx(angle_histogram(full, SAM_EDGES))
    assert mean == pytest.approx(float(full.mean()))


def test_inter_modal_deviation_and_variation_by_hand():
    images_ref, texts_ref = at(0, 90), at(20, 110)  # each image 20 degrees from its text
    images, texts = at(40, 130), at(48, 138)  # images turned 40, texts 28: now 8 degrees apart
    assert inter_modal_angle_variation(images_ref, texts_ref, images, texts).tolist() == pytest.approx([12.0, 12.0])
    result = spatial_disorder(images_ref, texts_ref, images, texts, correct=torch.tensor([True, False]))
    assert result.scalars["image_rotation_mean"] == pytest.approx(40.0)
    assert result.scalars["text_rotation_mean"] == pytest.approx(28.0)
    assert result.scalars["rotation_mean_gap"] == pytest.approx(12.0)
    assert result.image_rotation == pytest.approx([0, 0, 0, 0, 100.0])  # (30,180]
    assert result.text_rotation == pytest.approx([0, 0, 0, 100.0, 0])  # (25,30]
    assert result.inter_modal_variation == pytest.approx([0, 0, 100.0, 0, 0]) and result.num_correct == 1
    assert i2t_top1_correct(images_ref, texts_ref).tolist() == [True, True]
    assert i2t_top1_correct(at(0, 10), at(80, 5)).tolist() == [False, True]  # both images are nearest text 1


def test_model_pair_on_an_eval_set_and_plot(tmp_path, clip_tokenizer, image_processor):
    dataset = build_stream("flickr8k-random5", max_train_per_task=4, max_eval_per_task=6)[0].eval
    first, later = tiny_clip(seed=0), tiny_clip(seed=1)
    for model in (first, later):
        model.align_special_tokens(clip_tokenizer)
    same = spatial_disorder_between(first, first, dataset, image_processor, clip_tokenizer, batch_size=4)
    assert same.image_sam_change[0] == pytest.approx(100.0) and same.image_rotation[0] == pytest.approx(100.0)
    assert same.scalars["inter_modal_variation_mean"] == pytest.approx(0.0, abs=1e-3)
    reference = embed_for_disorder(
        first, dataset["image"], list(dataset["texts"]), image_processor, clip_tokenizer, batch_size=4
    )
    assert reference.images.shape[0] == reference.texts.shape[0] == reference.correct.shape[0] == 6
    moved = spatial_disorder_between(
        first, later, dataset, image_processor, clip_tokenizer, batch_size=4, reference=reference
    )
    assert moved.num_samples == 6 and moved.num_correct == int(reference.correct.sum())
    for histogram in (moved.image_sam_change, moved.text_sam_change, moved.image_rotation, moved.text_rotation):
        assert sum(histogram) == pytest.approx(100.0)
    assert moved.scalars["image_rotation_mean"] > same.scalars["image_rotation_mean"]
    assert set(moved.to_dict()) >= {"scalars", "image_rotation", "ram_edges"}
    path = plot_spatial_disorder({"0 -> 0": same, "0 -> 1": moved}, tmp_path / "sd.png")
    assert path.exists() and path.stat().st_size > 0


def test_disorder_is_measured_after_every_task_of_a_run(tmp_path, clip_tokenizer):
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor
    from hf_ccl.methods import build_methods
    from hf_ccl.testing import tiny_clip

    stream = build_stream("flickr8k-random5", max_train_per_task=16, max_eval_per_task=12)
    stream.tasks = stream.tasks[:2]
    args = ContinualArguments(
        output_dir=str(tmp_path), training={"max_steps": 2, "per_device_train_batch_size": 8}, progress=False,
        diagnostics={"spatial_disorder_task": 0},
    )
    learner = ContinualLearner(tiny_clip(), stream, build_methods(["finetune"]), load_image_processor(32),
                               clip_tokenizer, args)
    learner.fit()
    saved = json.loads((tmp_path / "task-1" / "spatial_disorder.json").read_text())
    assert list(saved) == ["initial -> flickr8k-0", "initial -> flickr8k-1"]
    assert (tmp_path / "spatial_disorder.png").exists()
