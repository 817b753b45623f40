"""DataLoader workers by default on a GPU, and the caption sampler in worker processes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import hf_ccl.continual as continual
import hf_ccl.data.workers as workers
from hf_ccl.continual import ContinualArguments, ContinualLearner
from hf_ccl.data import CLIPCollator, build_stream, load_image_processor, load_tokenizer
from hf_ccl.data.workers import dataloader_defaults, default_num_workers, training_device_type
from hf_ccl.methods import build_methods
from hf_ccl.testing import tiny_clip


def test_default_num_workers() -> None:
    assert default_num_workers("cpu", 64) == 0  # the training step needs the cores
    assert default_num_workers("mps", 8) == 0
    assert default_num_workers("cuda", 1) == 0  # one core: the process prepares its batches itself
    assert default_num_workers("cuda", 2) == 1
    assert default_num_workers("cuda", 6) == 5
    assert default_num_workers("cuda", 64) == 8  # capped
    assert default_num_workers("cuda", 64, cap=12) == 12
    assert default_num_workers("cuda", 16, local_processes=4) == 3  # each process's share, less itself
    assert default_num_workers("cuda", 4, local_processes=8) == 0
    with pytest.raises(ValueError, match="cores"):
        default_num_workers("cuda", 0)
    with pytest.raises(ValueError, match="local_processes"):
        default_num_workers("cuda", 8, local_processes=0)


def test_dataloader_defaults_respect_the_users_settings() -> None:
    assert dataloader_defaults({}, "cpu", cores=16) == {"dataloader_num_workers": 0}
    assert dataloader_defaults({}, "cuda", cores=16, local_processes=2) == {
        "dataloader_num_workers": 7, "dataloader_persistent_workers": True}
    assert dataloader_defaults({}, "cuda", cores=1) == {"dataloader_num_workers": 0}
    assert dataloader_defaults({"dataloader_num_workers": 0}, "cuda", cores=16) == {}
    assert dataloader_defaults({"dataloader_num_workers": 3}, "cuda", cores=16) == {}
    assert dataloader_defaults({"dataloader_persistent_workers": False}, "cuda", cores=4) == {
        "dataloader_num_workers": 3}


def test_usable_cores_and_local_processes(monkeypatch) -> None:
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert workers.usable_cores() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert workers.local_process_count() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert workers.local_process_count() == 1


def test_device_type(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert training_device_type({}) == "cuda"
    assert training_device_type({"use_cpu": True}) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training_device_type({}) == "cpu"


@pytest.fixture(scope="module")
def learner_factory(tmp_path_factory):
    stream = build_stream("digits", max_train_per_task=16, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]
    processor, tokenizer = load_image_processor(32), load_tokenizer()

    def make(training: dict) -> ContinualLearner:
        args = ContinualArguments(output_dir=str(tmp_path_factory.mktemp("run")), progress=False, training=training)
        return ContinualLearner(tiny_clip(seed=0), stream, build_methods("finetune"), processor, tokenizer, args)

    return make


def test_training_arguments_take_the_default(learner_factory, monkeypatch) -> None:
    context = SimpleNamespace(task_index=0)
    monkeypatch.setattr(workers, "usable_cores", lambda: 5)
    monkeypatch.setattr(workers, "local_process_count", lambda: 1)
    monkeypatch.setattr(continual, "training_device_type", lambda training: "cuda")
    args = learner_factory({})._training_arguments(context)
    assert args.dataloader_num_workers == 4 and args.dataloader_persistent_workers
    args = learner_factory({"dataloader_num_workers": 1})._training_arguments(context)
    assert args.dataloader_num_workers == 1 and not args.dataloader_persistent_workers
    monkeypatch.setattr(continual, "training_device_type", lambda training: "cpu")
    args = learner_factory({})._training_arguments(context)
    assert args.dataloader_num_workers == 0 and not args.dataloader_persistent_workers


# ----- the caption sampler in worker processes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def caption_rows(shared_data_root) -> list[dict]:
    """Flickr8k rows (five captions each) without images: only the captions are drawn here."""
    from hf_ccl.data import to_canonical
    from hf_ccl.data.builders import load_split

    raw = load_split(shared_data_root / "flickr8k", "test")
    data = to_canonical(raw, source="flickr8k", split="test", text_column="en", indices=range(16))
    return [{"texts": data[i]["texts"], "image_id": data[i]["image_id"]} for i in range(len(data))]


class _Draws:
    """A picklable collate_fn that returns the caption indices a `CLIPCollator` draws (no images, no tokenizer)."""

    def __init__(self, seed: int, num_workers: int) -> None:
        self.collator = CLIPCollator(None, SimpleNamespace(model_max_length=77), seed=seed, num_workers=num_workers)

    def __call__(self, rows: list[dict]) -> list[int]:
        return self.collator._choose(rows)[1]


def _epochs(rows: list[dict], num_workers: int, persistent: bool, seed: int = 0, epochs: int = 2) -> list[list[int]]:
    torch.manual_seed(1234)  # the DataLoader draws its workers' base seed from torch's generator
    loader = torch.utils.data.DataLoader(rows, batch_size=4, num_workers=num_workers, collate_fn=_Draws(seed, num_workers),
                                         persistent_workers=persistent)
    return [[index for batch in loader for index in batch] for _ in range(epochs)]


def test_worker_draws_are_reproducible_and_new_every_epoch(caption_rows) -> None:
    for persistent in (False, True):
        first = _epochs(caption_rows, 2, persistent)
        assert _epochs(caption_rows, 2, persistent) == first  # a seeded run draws the same
        assert first[0] != first[1], "each epoch draws anew, also when workers restart every epoch"
        assert _epochs(caption_rows, 2, persistent, seed=1) != first
    main = _epochs(caption_rows, 0, False)
    assert main[0] != main[1] and _epochs(caption_rows, 0, False) == main


def test_resume_with_workers_warns(caption_rows, caplog) -> None:
    collator = CLIPCollator(None, SimpleNamespace(model_max_length=77), seed=3)
    collator.choose_texts(caption_rows)
    state = collator.state_dict()
    assert state["num_workers"] == 0
    expected = [collator.choose_texts(caption_rows) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="hf_ccl.data.collate"):
        exact = CLIPCollator(None, SimpleNamespace(model_max_length=77), seed=3)
        exact.load_state_dict(state)
        assert [exact.choose_texts(caption_rows) for _ in range(3)] == expected  # in the main process: exact
        assert not caplog.records
        CLIPCollator(None, SimpleNamespace(model_max_length=77), seed=3, num_workers=2).load_state_dict(state)
    assert "different (equally random) captions" in caplog.text
    with pytest.raises(ValueError, match="num_workers"):
        CLIPCollator(None, SimpleNamespace(model_max_length=77), num_workers=-1)
