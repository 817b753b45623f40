"""The preprocessing cache: exact pixel values on real bundled images, reuse on disk, refusals, and the loop option."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers import CLIPImageProcessorPil

from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream, load_image_processor, load_tokenizer, to_canonical
from hf_ccl.data.builders import CANONICAL_FEATURES, load_split
from hf_ccl.data.image_cache import (
    PIXELS_COLUMN,
    cache_key,
    cached_pixels_dataset,
    check_image_cache,
    output_size,
    pixel_lookup,
    pixels_to_tensor,
)
from hf_ccl.methods import build_methods
from hf_ccl.testing import TrainingLogRecorder, tiny_clip
from hf_ccl.validation import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def rows_dataset(shared_data_root) -> Dataset:
    """Six Flickr8k test rows plus two made non-square (a real image cropped to 64x40 and to 30x64, stored as PNG),
    so resize keeps an aspect ratio and the centre crop cuts something."""
    raw = load_split(shared_data_root / "flickr8k", "test")
    data = to_canonical(raw, source="flickr8k", split="test", text_column="en", indices=range(8))
    rows = [data[i] for i in range(len(data))]
    for index, box in ((6, (0, 10, 64, 50)), (7, (20, 0, 50, 64))):
        image = Image.open(io.BytesIO(rows[index]["image"]["bytes"])).convert("RGB").crop(box)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        rows[index] = dict(rows[index], image={"bytes": buffer.getvalue(), "path": None})
    return Dataset.from_list(rows, features=CANONICAL_FEATURES)


@pytest.mark.parametrize("size", [32, 48])
def test_cached_pixels_equal_the_processor_path(tmp_path, rows_dataset, tokenizer, size) -> None:
    processor = load_image_processor(size)  # the real CLIP settings (bicubic, OpenAI mean/std), at a small size
    cached = cached_pixels_dataset(rows_dataset, processor, cache_dir=tmp_path)
    assert "image" not in cached.column_names and PIXELS_COLUMN in cached.column_names
    first = cached[0][PIXELS_COLUMN]
    assert isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.shape == (size, size, 3)
    assert isinstance(cached[0]["texts"], list) and isinstance(cached[0]["image_id"], str)
    collator = CLIPCollator(processor, tokenizer, train=False)
    plain = collator([rows_dataset[i] for i in range(len(rows_dataset))])
    fast = collator([cached[i] for i in range(len(cached))])
    assert set(plain) == set(fast)
    for key in plain:  # the same uint8 intermediate and the processor's own arithmetic: equal, not just close
        assert torch.equal(plain[key], fast[key]), key


def test_lookup_follows_the_processor_settings() -> None:
    processor = CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8},
                                      image_mean=[0.5, 0.25, 0.0], image_std=[0.5, 0.5, 2.0])
    lookup = pixel_lookup(processor)
    assert lookup.shape == (3, 256) and lookup.dtype == torch.float32
    values = torch.arange(256, dtype=torch.float64) / 255
    expected = torch.stack([(values - 0.5) / 0.5, (values - 0.25) / 0.5, values / 2.0]).float()
    assert torch.allclose(lookup, expected, atol=1e-6)
    raw = pixel_lookup(CLIPImageProcessorPil(do_rescale=False, do_normalize=False))
    assert torch.equal(raw, torch.arange(256, dtype=torch.float32).expand(3, 256))


def test_second_build_reuses_the_cache_and_settings_key_it(tmp_path, rows_dataset, monkeypatch) -> None:
    processor = load_image_processor(32)
    first = cached_pixels_dataset(rows_dataset, processor, cache_dir=tmp_path, num_proc=2)
    folders = sorted(path.name for path in tmp_path.iterdir())
    assert folders == [cache_key(rows_dataset, processor)]  # no work folder left behind

    def no_map(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the cache was built again")

    monkeypatch.setattr(Dataset, "map", no_map)
    again = cached_pixels_dataset(rows_dataset, processor, cache_dir=tmp_path)
    assert np.array_equal(np.stack(again[PIXELS_COLUMN]), np.stack(first[PIXELS_COLUMN]))
    # normalisation is applied at batch time: other mean/std use the same cache; another size does not
    assert cache_key(rows_dataset, load_image_processor(32, image_mean=[0.5] * 3)) == folders[0]
    assert cache_key(rows_dataset, load_image_processor(40)) != folders[0]
    assert cache_key(rows_dataset.select(range(4)), processor) != folders[0]


def test_refusals(rows_dataset, tokenizer) -> None:
    varying = CLIPImageProcessorPil(size={"shortest_edge": 32}, do_center_crop=False)
    with pytest.raises(ValueError, match="varying size"):
        output_size(varying)
    assert output_size(CLIPImageProcessorPil(size={"height": 20, "width": 30}, do_center_crop=False)) == (20, 30)
    with pytest.raises(ValueError, match="map-style"):
        cached_pixels_dataset(rows_dataset.to_iterable_dataset(), load_image_processor(32))
    with pytest.raises(ValueError, match="other processor settings"):
        pixels_to_tensor([np.zeros((16, 16, 3), np.uint8)], pixel_lookup(load_image_processor(32)), (32, 32))
    mixed = [dict(rows_dataset[0]), {**rows_dataset[1], PIXELS_COLUMN: np.zeros((32, 32, 3), np.uint8)}]
    with pytest.raises(ValueError, match="mixes rows"):
        CLIPCollator(load_image_processor(32), tokenizer)(mixed)


# ----- the loop option ------------------------------------------------------------------------------------------
def _learner(tmp_path, name: str, image_cache, processor=None, recorder=None) -> ContinualLearner:  # noqa: ANN001
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]
    args = ContinualArguments(
        output_dir=str(tmp_path / name), progress=False, evaluation={"initial": False}, save_checkpoints=False,
        image_cache=image_cache, training={"per_device_train_batch_size": 8, "num_train_epochs": 1, "logging_steps": 1},
    )
    return ContinualLearner(tiny_clip(seed=0), stream, build_methods("finetune"), processor or load_image_processor(32),
                            load_tokenizer(), args, task_callbacks=[recorder] if recorder else None)


def test_loop_trains_the_same_from_the_cache(tmp_path) -> None:
    plain, cached = TrainingLogRecorder(), TrainingLogRecorder()
    reference = _learner(tmp_path, "plain", False, recorder=plain)
    reference.fit()
    learner = _learner(tmp_path, "cached", str(tmp_path / "cache"), recorder=cached)
    seen = []
    original = learner._train_dataset
    learner._train_dataset = lambda *a: seen.append(original(*a)) or seen[-1]  # noqa: E731
    learner.fit()
    assert [PIXELS_COLUMN in dataset.column_names for dataset in seen] == [True]
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert [log["loss"] for log in cached.step_logs(0)] == [log["loss"] for log in plain.step_logs(0)]
    for (name, a), (_, b) in zip(reference.model.state_dict().items(), learner.model.state_dict().items(),
                                 strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_loop_option_is_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="image_cache must be"):
        ContinualArguments(output_dir=str(tmp_path), image_cache="")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="image_cache must be"):
        ContinualArguments(output_dir=str(tmp_path), image_cache=str(tmp_path / "file"))
    assert ContinualArguments(output_dir=str(tmp_path), image_cache="true").image_cache is True
    varying = CLIPImageProcessorPil(size={"shortest_edge": 32}, do_center_crop=False)
    with pytest.raises(ConfigError, match="varying size"):
        _learner(tmp_path, "varying", True, processor=varying)
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = [dataclasses.replace(stream.tasks[0], train=stream.tasks[0].train.to_iterable_dataset())]
    with pytest.raises(ConfigError, match="train on a stream"):
        check_image_cache(stream, load_image_processor(32), True)
    check_image_cache(stream, load_image_processor(32), False)  # off: nothing to check
