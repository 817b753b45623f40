"""Safe run folders and checkpoint integrity, through the CLI as a user meets them: no new run over another run's
files, one run per folder, a resume that must match the saved settings, damaged or missing checkpoint files named,
an incomplete Trainer checkpoint skipped, finished tasks' Trainer checkpoints removed."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_ccl.checkpoint_files import MANIFEST, CheckpointError, verify_checkpoint, write_manifest
from hf_ccl.cli import main
from hf_ccl.resume_settings import allowed, flatten, settings_diff
from hf_ccl.run_folder import LOCK_FILE, RunFolderError, RunFolderLock

# 5 digits tasks x 2 steps, ER (a method with state files), a Trainer checkpoint every step.
RUN = ["--config", "digits", "progress=false", "methods=[er]", "training.max_steps=2",
       "training.per_device_train_batch_size=16", "stream_args.max_train_per_task=32", "stream_args.max_eval_per_task=10",
       "model.config.hidden_size=32", "model.config.num_layers=1"]


def train(output_dir: Path, *overrides: str) -> int:
    return main(["train", *RUN, f"output_dir={output_dir}", *overrides])


def rows(output_dir: Path) -> list:
    return json.loads((output_dir / "results.json").read_text())["rows"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A whole run, with mid-task checkpoints kept for the last task's inspection."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    assert train(output_dir, "training.save_strategy=steps", "training.save_steps=1") == 0
    return output_dir


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> Path:
    """The same run, keeping every task's mid-task Trainer checkpoints."""
    output_dir = tmp_path_factory.mktemp("kept") / "run"
    assert train(output_dir, "training.save_strategy=steps", "training.save_steps=1",
                 "keep_trainer_checkpoints=true") == 0
    return output_dir


@pytest.fixture
def stopped(finished, tmp_path) -> Path:
    """The finished run as if stopped after task 2: task-3/ and task-4/ removed."""
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    for index in (3, 4):
        shutil.rmtree(output_dir / f"task-{index}")
    return output_dir


# ----- manifests ---------------------------------------------------------------------------------------------------
def test_every_task_checkpoint_has_a_manifest_that_verifies(finished):
    for index in range(5):
        folder = finished / f"task-{index}"
        manifest = json.loads((folder / MANIFEST).read_text())
        assert {"model.safetensors", "tokenizer.json", "compute.json", "method_state.json", "results.json",
                "continual_state.json", "README.md"} <= set(manifest["files"])
        verify_checkpoint(folder)


def test_finished_tasks_trainer_checkpoints_are_removed(finished, kept):
    assert not (finished / "trainer").exists() or not any((finished / "trainer").iterdir())
    for index in range(5):
        checkpoints = sorted((kept / "trainer" / f"task-{index}").glob("checkpoint-*"))
        assert checkpoints and all((c / MANIFEST).exists() for c in checkpoints)


@pytest.mark.parametrize(("damage", "named"), [
    (lambda f: _flip(f / "model.safetensors"), "model.safetensors does not match its checksum"),
    (lambda f: _cut(f / "model.safetensors"), "model.safetensors has"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda f: (f / "compute.json").unlink(), "compute.json is missing"),
    (lambda f: (f / "method_state.json").unlink(), "method_state.json is missing"),
    (lambda f: (f / MANIFEST).write_text("{oops"), f"Cannot read {{}}/{MANIFEST}"),
])
def test_a_damaged_task_checkpoint_is_an_error_naming_the_file(stopped, capsys, damage, named):
    folder = stopped / "task-2"
    damage(folder)
    assert train(stopped, "resume_from_checkpoint=true") == 1
    err = capsys.readouterr().err
    assert named.replace("{}", str(folder)) in err and str(folder) in err
    assert not (stopped / "task-3").exists()  # nothing trained from it


def test_a_checkpoint_without_manifest_is_incomplete(tmp_path):
    (tmp_path / "continual_state.json").write_text("{}")
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(CheckpointError, match="has no checkpoint_manifest.json: it is incomplete"):
        verify_checkpoint(tmp_path)
    write_manifest(tmp_path)
    assert verify_checkpoint(tmp_path) == []
    (tmp_path / "results.json").write_text("[]")  # same size, other bytes: {} vs []
    with pytest.raises(CheckpointError, match="results.json does not match its checksum"):
        verify_checkpoint(tmp_path)


def test_a_task_folder_without_manifest_is_skipped_and_extra_files_are_never_read(finished, stopped, caplog):
    """task-2's manifest deleted and its weights damaged: it is not used (task 2 trains again from task-1). task-1
    holds a `special_tokens_map.json` placed there later, with another pad token: ignored. The run ends as the
    uninterrupted one."""
    (stopped / "task-2" / MANIFEST).unlink()
    _flip(stopped / "task-2" / "model.safetensors")
    (stopped / "task-1" / "special_tokens_map.json").write_text(json.dumps({"pad_token": "!"}))
    (stopped / "task-1" / "model.safetensors.index.json").write_text("{}")
    assert train(stopped, "resume_from_checkpoint=true") == 0
    assert "task-2 is incomplete (no checkpoint_manifest.json" in caplog.text
    assert "special_tokens_map.json" in caplog.text and "(ignored)" in caplog.text
    assert rows(stopped) == rows(finished)
    assert json.loads((stopped / "task-4" / "tokenizer_config.json").read_text()).get("pad_token") != "!"


def test_a_hand_edited_model_card_does_not_block_a_resume(finished, stopped, caplog):
    card = stopped / "task-2" / "README.md"
    card.write_text(card.read_text() + "\nNotes of the person who trained it.\n")
    assert train(stopped, "resume_from_checkpoint=true") == 0
    assert "README.md was changed after the checkpoint was written" in caplog.text
    assert rows(stopped) == rows(finished)


def test_allowed_label_space_change_is_recorded_and_an_unallowed_one_refused(stopped, capsys):
    assert train(stopped, "resume_from_checkpoint=true", "stream_args.label_space=all") == 1
    err = capsys.readouterr().err
    assert "the data of task(s) [0, 1, 2, 3, 4] differs (task 0 classes 2 -> 10" in err
    assert not (stopped / "task-3").exists()
    assert train(stopped, "resume_from_checkpoint=true", "stream_args.label_space=all",
                 "resume_allow_changes=[stream*]") == 0
    state = json.loads((stopped / "task-4" / "continual_state.json").read_text())
    changed = {change["key"] for change in state["resume_changes"]}
    assert "stream.tasks.0.labels.classes" in changed and "stream.tasks.4.labels.digest" in changed
    card = (stopped / "task-4" / "README.md").read_text()
    assert "stream.tasks.0.labels.classes" in card


def test_run_files_are_never_written_through_a_planted_link(finished, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    for name in ("compute.json", "results.json", "run_config.yaml"):
        (output_dir / name).unlink()
        (output_dir / name).symlink_to(outside)
    assert train(output_dir, "resume_from_checkpoint=true", "training.save_strategy=steps",
                 "training.save_steps=1") == 0
    assert outside.read_text() == "keep me"
    assert not any((output_dir / name).is_symlink() for name in ("compute.json", "results.json", "run_config.yaml"))


# ----- the folder: another run, the lock ----------------------------------------------------------------------------
def test_a_new_run_over_another_run_is_refused_then_overwritten(stopped, capsys):
    before = sorted(p.name for p in stopped.iterdir())
    started = time.monotonic()
    assert train(stopped, "seed=1") == 2  # refused before the run is built
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err
    assert "holds another run" in err and "resume_from_checkpoint=true" in err and "overwrite_output_dir" in err
    assert sorted(p.name for p in stopped.iterdir()) == before  # nothing written, not even run_config.yaml
    assert train(stopped, "seed=1", "overwrite_output_dir=true") == 0
    state = json.loads((stopped / "task-4" / "continual_state.json").read_text())
    assert state["seed"] == 1 and state["settings"]["seed"] == 1


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys):
    assert train(tmp_path / "run", "overwrite_output_dir=true", "resume_from_checkpoint=true") == 2
    assert "overwrite_output_dir" in capsys.readouterr().err


def test_a_locked_folder_is_refused_at_once_and_a_dead_holder_does_not_count(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from hf_ccl.run_folder import RunFolderLock; "
        f"lock = RunFolderLock({str(folder)!r}); lock.acquire(); print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderError, match=rf"in use by another run \(pid {holder.pid} on "):
            RunFolderLock(folder).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind by kill -9 ...
    with RunFolderLock(folder):  # ... and taken over: the kernel released the flock
        pass


def test_a_second_cli_run_on_a_busy_folder_fails_naming_the_first(tmp_path, capsys):
    folder = tmp_path / "run"
    lock = RunFolderLock(folder)
    lock.acquire()
    try:
        started = time.monotonic()
        assert train(folder) == 2  # refused before the run is built
        assert train(folder, "overwrite_output_dir=true") == 2  # an overwrite too
        assert time.monotonic() - started < 30
    finally:
        lock.release()
    assert capsys.readouterr().err.count("is in use by another run (pid") == 2
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]


@pytest.mark.slow
def test_an_overwrite_cannot_replace_a_running_run(tmp_path):
    """A second run told to overwrite, started while the first one trains, is refused; the first one's results are
    those of an undisturbed run."""
    folder = tmp_path / "run"
    command = [sys.executable, "-m", "hf_ccl.cli", "train", *RUN, f"output_dir={folder}", "training.max_steps=40"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (folder / "run_config.yaml").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run([*command, "overwrite_output_dir=true"], capture_output=True, text=True)
        assert second.returncode == 2 and "is in use by another run" in second.stderr
    finally:
        out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-2000:]


def test_what_a_failed_first_run_left_does_not_block_the_next(tmp_path, caplog):
    folder = tmp_path / "run"
    (folder / "trainer" / "task-0").mkdir(parents=True)
    (folder / "run_config.yaml").write_text("seed: 5\n")
    assert train(folder) == 0
    assert (folder / "task-4" / MANIFEST).exists()


# ----- resume must match --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "key"), [
    ("seed=1", "seed: 0 -> 1"),
    ("training.learning_rate=0.002", "training.learning_rate: 0.001 -> 0.002"),
    ("method_args.er.buffer_size=7", "method_args.er.buffer_size: "),
    ("stream_args.max_train_per_task=24", "the data of task(s) [0, 1, 2, 3, 4] differs (task 0 train rows 32 -> 24"),
])
def test_a_resume_with_other_settings_is_refused_with_a_diff(stopped, capsys, override, key):
    assert train(stopped, "resume_from_checkpoint=true", override) == 1
    err = capsys.readouterr().err
    assert "was written with other settings than this run's" in err and key in err
    assert "resume_allow_changes=[" in err
    assert not (stopped / "task-3").exists()


def test_an_allowed_change_is_recorded(stopped):
    assert train(stopped, "resume_from_checkpoint=true", "training.learning_rate=0.002",
                 "resume_allow_changes=[training.learning_rate]") == 0
    for index in (3, 4):
        state = json.loads((stopped / f"task-{index}" / "continual_state.json").read_text())
        assert state["resume_changes"] == [
            {"after_task": 2, "key": "training.learning_rate", "saved": 0.001, "now": 0.002}]


def test_an_allowed_learning_rate_change_applies_inside_the_interrupted_task(finished, kept, tmp_path):
    """Stopped mid-task 3 (its Trainer checkpoint-1 kept), resumed with another learning rate: the rest of task 3
    trains with it (the saved optimizer and schedule keep their state, not their old rate)."""
    import torch

    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    for index in (3, 4):
        shutil.rmtree(output_dir / f"task-{index}")
    shutil.copytree(kept / "trainer" / "task-3" / "checkpoint-1", output_dir / "trainer" / "task-3" / "checkpoint-1")
    assert train(output_dir, "resume_from_checkpoint=true", "training.save_strategy=steps", "training.save_steps=1",
                 "keep_trainer_checkpoints=true", "training.learning_rate=0.002",
                 "resume_allow_changes=[training.learning_rate]") == 0
    scheduler = torch.load(output_dir / "trainer" / "task-3" / "checkpoint-2" / "scheduler.pt", weights_only=True)
    assert scheduler["base_lrs"] and all(rate == 0.002 for rate in scheduler["base_lrs"])
    optimizer = torch.load(output_dir / "trainer" / "task-3" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert all(group["initial_lr"] == 0.002 for group in optimizer["param_groups"])


def test_settings_diff_flattens_and_allows_by_pattern():
    saved = {"seed": 0, "training": {"learning_rate": 1e-3}, "method_args": {"er": {"buffer_size": 5}}}
    now = {"seed": 0, "training": {"learning_rate": 2e-3, "max_steps": 4}, "method_args": {"er": {"buffer_size": 7}}}
    assert settings_diff(saved, now) == [("method_args.er.buffer_size", 5, 7),
                                         ("training.learning_rate", 1e-3, 2e-3),
                                         ("training.max_steps", "<not set>", 4)]
    assert allowed("method_args.er.buffer_size", ["method_args.er"])
    assert allowed("training.learning_rate", ["training.*"]) and not allowed("seed", ["training.*"])
    assert flatten({"tasks": [{"name": "a"}], "methods": ["er"]}) == {"tasks.0.name": "a", "methods": ["er"]}


# ----- Trainer checkpoints and the run's own files ------------------------------------------------------------------
def test_an_incomplete_trainer_checkpoint_is_skipped(finished, kept, tmp_path, caplog):
    """Killed during task 3's second Trainer checkpoint: the first one is used, the run ends as the uninterrupted one."""
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    for index in (3, 4):
        shutil.rmtree(output_dir / f"task-{index}")
    shutil.copytree(kept / "trainer" / "task-3", output_dir / "trainer" / "task-3")
    cut = output_dir / "trainer" / "task-3" / "checkpoint-2"
    (cut / MANIFEST).unlink()
    (cut / "optimizer.pt").unlink()
    assert train(output_dir, "resume_from_checkpoint=true", "training.save_strategy=steps",
                 "training.save_steps=1") == 0
    assert "checkpoint-2 is incomplete or damaged" in caplog.text
    assert rows(output_dir) == rows(finished)


def test_killed_before_the_first_task_checkpoint_resumes_task_0_mid_task(finished, kept, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(kept / "trainer" / "task-0" / "checkpoint-1", output_dir / "trainer" / "task-0" / "checkpoint-1")
    assert train(output_dir, "resume_from_checkpoint=true", "training.save_strategy=steps",
                 "training.save_steps=1") == 0
    assert rows(output_dir) == rows(finished)


def test_resuming_a_finished_run_rewrites_its_files(finished, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(finished, output_dir)
    (output_dir / "results.json").unlink()
    (output_dir / "compute.json").write_text("{}")
    assert train(output_dir, "resume_from_checkpoint=true", "training.save_strategy=steps",
                 "training.save_steps=1") == 0
    assert rows(output_dir) == rows(finished)
    assert (output_dir / "compute.json").read_text() == (output_dir / "task-4" / "compute.json").read_text()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
