"""Resume: a stopped run continues from its last complete task, or mid-task from the Trainer's checkpoint, with every
method's state, and ends with the same results matrix as an uninterrupted run with the same seed.

That every registered method resumes exactly after a task (parameters, method state, matrix) is checked over the
registry in `tests/test_method_registry.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_ccl.continual import latest_task_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "resumable_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import resumable_run  # noqa: E402

# CPU training of the same model on the same batches is bit-for-bit reproducible; allow float noise anyway.
TOLERANCE = 1e-6


def _matrix(results) -> np.ndarray:
    return np.array([[m for task in row.metrics.values() for m in task.values()] for row in results.rows])


def _run(output_dir: Path, methods: str, resume: bool = False, callbacks=()):
    learner = resumable_run.build_learner(str(output_dir), methods.split("+"), resume, None, list(callbacks))
    return learner, learner.fit()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per method set, shared by the tests."""
    runs = {}
    for methods in ("ctp+er", "si"):
        output_dir = tmp_path_factory.mktemp(methods.replace("+", "_"))
        runs[methods] = (output_dir, _run(output_dir, methods)[1])
    return runs


@pytest.mark.parametrize("methods", ["ctp+er"])  # single methods: test_method_registry's every-method resume
def test_resume_after_a_complete_task_matches_uninterrupted(reference, tmp_path, methods):
    source, expected = reference[methods]
    shutil.copytree(source / "task-0", tmp_path / "task-0")  # stopped after task 0
    learner, results = _run(tmp_path, methods, resume=True)
    assert [row.label for row in results.rows] == [row.label for row in expected.rows]
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)
    assert not (tmp_path / "trainer" / "task-0").exists(), "a finished task must never be trained twice"


class _Stop(Exception):
    pass


class _StopAtSave(resumable_run.KillAt):
    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
        if self.task_seen == self.task and state.global_step >= self.step:
            raise _Stop


@pytest.mark.parametrize("methods", ["ctp+er", "si"])
def test_resume_mid_task_matches_uninterrupted(reference, tmp_path, methods):
    _, expected = reference[methods]
    with pytest.raises(_Stop):
        _run(tmp_path, methods, callbacks=[_StopAtSave([], task=1, step=3)])
    assert latest_task_checkpoint(tmp_path).name == "task-0"
    assert (tmp_path / "trainer" / "task-1" / "checkpoint-3" / "hf_ccl" / "method_state.json").exists()
    _, results = _run(tmp_path, methods, resume=True)
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)
    counted = [[(task["samples_seen"], task["macs"]) for task in run.cost] for run in (results, expected)]
    assert counted[0] == counted[1]  # the resumed task's steps before the stop are counted once, as measured


def test_sigkill_mid_task_then_resume_in_a_new_process(reference, tmp_path):
    """A process killed with SIGKILL mid-task (no cleanup at all) resumes and ends with the uninterrupted matrix."""
    _, expected = reference["ctp+er"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    killed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ctp+er", "--kill-task", "1",
                             "--kill-at-step", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "final_results.json").exists()
    resumed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ctp+er", "--resume"], env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    from hf_ccl.evaluation.matrix import ResultsMatrix

    results = ResultsMatrix.from_dict(json.loads((tmp_path / "final_results.json").read_text())["matrix"])
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=TOLERANCE)


def test_corrupt_checkpoint_is_a_clear_error_not_a_fresh_start(reference, tmp_path):
    source, _ = reference["si"]
    shutil.copytree(source / "task-1", tmp_path / "task-1")
    weights = tmp_path / "task-1" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        _run(tmp_path, "si", resume=True)
    shutil.rmtree(tmp_path / "task-1")
    shutil.copytree(source / "task-1", tmp_path / "task-1")
    (tmp_path / "task-1" / "method_state.json").write_text("{ not json", encoding="utf-8")
    with pytest.raises(ValueError, match="method_state.json"):
        _run(tmp_path, "si", resume=True)


def test_resume_with_other_methods_or_nothing_to_resume_fails(reference, tmp_path):
    source, _ = reference["si"]
    with pytest.raises(ValueError, match="no complete task checkpoint"):
        _run(tmp_path, "si", resume=True)
    shutil.copytree(source / "task-0", tmp_path / "task-0")
    with pytest.raises(ValueError, match="same methods"):
        _run(tmp_path, "ctp+er", resume=True)


def test_restore_takes_a_saved_tokenizer_of_the_same_length_with_other_merges(tmp_path):
    """`grow_vocab` may append merges without adding tokens: restore compares the tokenizers by content, not by
    length, so the resumed run tokenizes with the checkpoint's merges."""
    from hf_ccl.continual import ContinualArguments, ContinualLearner
    from hf_ccl.data import build_stream, load_image_processor, load_tokenizer
    from hf_ccl.methods import build_methods
    from hf_ccl.testing import tiny_clip

    stream = build_stream("digits", max_train_per_task=32, max_eval_per_task=8)
    stream.tasks = stream.tasks[:1]

    def learner(resume: bool) -> ContinualLearner:
        args = ContinualArguments(output_dir=str(tmp_path), training={"max_steps": 1, "per_device_train_batch_size": 16},
                                  progress=False, seed=1, evaluate_initial=False, resume_from_checkpoint=resume or None)
        return ContinualLearner(tiny_clip(seed=1), stream, build_methods(["grow_vocab"]), load_image_processor(32),
                                load_tokenizer(), args)

    def merges(tokenizer) -> list:  # noqa: ANN001
        return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]

    trained = learner(resume=False)
    trained.fit()
    original = load_tokenizer()
    assert len(trained.tokenizer) == len(original) and len(merges(trained.tokenizer)) > len(merges(original))
    resumed = learner(resume=True)
    assert resumed.restore(tmp_path / "task-0") == 0
    assert merges(resumed.tokenizer) == merges(trained.tokenizer)
