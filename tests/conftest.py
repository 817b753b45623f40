"""Shared fixtures: the real CLIP tokenizer, a PIL image processor, tiny random CLIPs."""

from __future__ import annotations

import os

# No test may reach the Hugging Face Hub: make every HF library fail fast instead of retrying the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Under pytest-xdist (`make test` runs `-n 2`), each worker is one of the machine's cores: one thread each (set
# before torch is imported), so that two workers do not fight over the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
from transformers import AutoTokenizer, CLIPImageProcessorPil  # noqa: E402

from hf_ccl.paths import data_root, default_tokenizer_path  # noqa: E402
from hf_ccl.testing import tiny_clip  # noqa: E402


@pytest.fixture(scope="session")
def clip_tokenizer():
    path = default_tokenizer_path()
    assert path.is_dir(), f"the real CLIP tokenizer is expected at {path} (set HF_CCL_SHARED)"
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def image_processor():
    return CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


@pytest.fixture(scope="session")
def shared_data_root():
    root = data_root()
    assert root.is_dir(), f"the bundled datasets are expected at {root} (set HF_CCL_DATA_ROOT)"
    return root


@pytest.fixture
def tiny_model():
    return tiny_clip(seed=0)


@pytest.fixture
def local_hub(tmp_path):
    """A running local Hub server (repos under tmp_path), with huggingface_hub and transformers pointed at it and a
    fresh HF cache, for the duration of the test. See hf_ccl.testing.hub_server."""
    from hf_ccl.testing import LocalHubServer

    with LocalHubServer(tmp_path / "local-hub") as server, server.patch_client(cache_dir=tmp_path / "hf-cache"):
        yield server


@pytest.fixture(scope="session")
def pair_stream(shared_data_root):
    """The first three tasks of `flickr-fashion-pairs` (image-en, en-de, image-de), 64 train / 32 eval pairs each."""
    from hf_ccl.data import TaskStream, build_stream

    stream = build_stream("flickr-fashion-pairs", max_train_per_task=64, max_eval_per_task=32)
    return TaskStream(stream.name, stream.tasks[:3])
