"""The wheel as a user gets it: built from this checkout, installed into a fresh virtual environment, its default
recipe run from a folder that has no shared/ beside it (slow: a fresh venv installs every dependency)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from hf_ccl.paths import HUB_CLIP_TOKENIZER, default_tokenizer_path

REPO = Path(__file__).resolve().parents[1]
TINY = ["progress=false", "training.max_steps=2", "training.per_device_train_batch_size=16",
        "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=10", "model.config.hidden_size=32",
        "model.config.num_layers=1"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this checkout (torch pinned by the constraints file); its `bin/`."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(root / "dist"), str(REPO)],
                   check=True)
    wheel = next((root / "dist").glob("hf_ccl-*.whl"))
    venv.create(root / "venv", with_pip=True)
    bin_dir = root / "venv" / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt"),
                    str(wheel)], check=True)
    return bin_dir


def _user_env(**extra: str) -> dict[str, str]:
    """The environment of a user who installed the wheel: no hf_ccl variables, no checkout on the path."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("HF_CCL_", "PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFF"))}
    return {**env, **extra}


@pytest.mark.slow
def test_the_default_recipe_runs_from_the_wheel_with_the_tokenizer_from_the_hub(installed, tmp_path):
    from hf_ccl.testing import local_hub_process

    with local_hub_process(tmp_path / "hub") as endpoint:
        env = _user_env(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"), NO_PROXY="127.0.0.1")
        upload = ("import sys; from huggingface_hub import HfApi; api = HfApi(token='hf_test'); "
                  "api.create_repo(sys.argv[1], exist_ok=True); api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2])")
        subprocess.run([sys.executable, "-c", upload, HUB_CLIP_TOKENIZER, str(default_tokenizer_path())], env=env,
                       check=True)
        ran = subprocess.run([str(installed / "hf-ccl"), "train", "--config", "digits", *TINY,
                              f"output_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "## Results matrix" in ran.stdout and (tmp_path / "run" / "task-4" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_without_shared_folder_or_hub_the_error_names_both_before_anything_is_built(installed, tmp_path):
    env = _user_env(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf-home"), NO_PROXY="127.0.0.1")
    ran = subprocess.run([str(installed / "hf-ccl"), "train", "--config", "digits", *TINY,
                          f"output_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 2, ran.stderr[-3000:]
    assert "HF_CCL_SHARED" in ran.stderr and HUB_CLIP_TOKENIZER in ran.stderr and "Traceback" not in ran.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_every_metric_module_loads_by_its_name_from_the_wheel(installed, tmp_path):
    code = ("import evaluate, hf_ccl.metrics as m; "
            "bad = [(n, evaluate.load(m.path(n)).name) for n in m.METRIC_MODULES if evaluate.load(m.path(n)).name != n]; "
            "assert not bad, bad")
    ran = subprocess.run([str(installed / "python"), "-c", code], cwd=tmp_path, env=_user_env(HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
