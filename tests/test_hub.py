"""Per-task revisions on a Hub (the local server of hf_ccl.testing): pushes, reloads by revision, cards, faults,
resume from the Hub, and one push per revision under 2 processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from transformers import CLIPModel, TrainerCallback

from hf_ccl.testing import FaultPlan

SCRIPT = Path(__file__).parent / "scripts" / "resumable_run.py"
sys.path.insert(0, str(SCRIPT.parent))
import resumable_run  # noqa: E402

REPO = "hf-ccl-test/clip-digits"


def _run(output_dir: Path, repo: str | None = REPO, resume: bool = False, callbacks=(), **hub):
    learner = resumable_run.build_learner(str(output_dir), ["er"], resume, repo, list(callbacks))
    for key, value in hub.items():  # options of the hub section (HubArguments)
        setattr(learner.args.hub, key, value)
    return learner, learner.fit()


def _matrix(results) -> np.ndarray:
    return np.array([[m for task in row.metrics.values() for m in task.values()] for row in results.rows])


def _commits(server) -> list:
    return [r for r in server.request_log if r.method == "POST" and "/commit/" in r.path and r.status == 200]


def test_three_tasks_push_three_revisions_that_reload_in_plain_transformers(local_hub, tmp_path):
    learner, results = _run(tmp_path)
    report = learner.push_report
    assert [r.task_index for r in report.records if r.pushed] == [0, 1, 2], report.summary()
    refs = HfApi().list_repo_refs(REPO)
    branches = {b.name: b.target_commit for b in refs.branches}
    assert {"main", "task-0", "task-1", "task-2"} <= set(branches)
    assert branches["main"] == branches["task-2"]
    assert len(set(branches[f"task-{k}"] for k in range(3))) == 3
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    previous = None
    for k in range(3):
        remote = CLIPModel.from_pretrained(REPO, revision=f"task-{k}")
        local = CLIPModel.from_pretrained(tmp_path / f"task-{k}")
        with torch.no_grad():
            remote_embeds = remote.get_image_features(pixel_values=pixels).pooler_output
            local_embeds = local.get_image_features(pixel_values=pixels).pooler_output
        torch.testing.assert_close(remote_embeds, local_embeds, rtol=0, atol=0)
        if previous is not None:
            assert not torch.allclose(remote_embeds, previous), "each task's revision holds that task's weights"
        previous = remote_embeds
        state = json.loads(Path(hf_hub_download(REPO, "continual_state.json", revision=f"task-{k}")).read_text())
        assert state["task_index"] == k
        files = set(HfApi().list_repo_files(REPO, revision=f"task-{k}"))
        assert {"model.safetensors", "method_state.json", "method_state.safetensors", "results.json", "README.md",
                "tokenizer_config.json", "preprocessor_config.json"} <= files
    card = ModelCard.load(hf_hub_download(REPO, "README.md", revision="task-1"))
    assert 'revision="task-1"' in card.text and REPO in card.text
    row = results.rows[-2]  # after task 1
    assert f"| after {row.label} |" in card.text
    assert len(card.data.eval_results) >= 2  # the two tasks trained by then
    assert len(_commits(local_hub)) == 3  # one commit per task


def test_the_pushed_card_keeps_one_result_per_task_of_a_shared_source(local_hub, tmp_path):
    """digits: every task is cut from one source. The card read back from the Hub by huggingface_hub's ModelCard holds
    one result per trained task and metric, under the task's own name, with the task's value."""
    from hf_ccl.cards import EVAL_METRICS

    learner, results = _run(tmp_path)
    assert len({task.source for task in learner.stream}) == 1
    key_of = {spec.metric_type: spec.key for spec in EVAL_METRICS}
    for revision, trained in (("task-1", 2), (None, 3)):  # main holds the newest task
        path = hf_hub_download(REPO, "README.md", revision=revision) if revision else REPO
        card = ModelCard.load(path)
        found = {}
        for result in card.data.eval_results:
            found.setdefault((result.dataset_name, result.metric_type), []).append(result)
        assert {name for name, _ in found} == set(results.task_names[:trained])  # untrained tasks left out
        row = [r for r in results.rows if r.label != "initial"][trained - 1]
        for (task, metric), entries in found.items():
            assert len(entries) == 1, f"{task} {metric}: {len(entries)} entries"
            assert entries[0].dataset_config == task
            assert entries[0].metric_value == pytest.approx(row.metrics[task][key_of[metric]], abs=1e-4)


def test_failing_hub_training_goes_on_and_failed_pushes_land_later(local_hub, tmp_path):
    """The Hub answers 500 to everything during tasks 0 and 1: training finishes, and the pushes land when it recovers."""

    class Recover(TrainerCallback):
        tasks = 0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            Recover.tasks += 1
            if Recover.tasks == 3:
                local_hub.faults = FaultPlan()

    local_hub.faults = FaultPlan(fail_every=1)
    learner, results = _run(tmp_path, callbacks=[Recover()], retries=1, backoff=0.01)
    assert results.num_trained == 3
    report = learner.push_report
    assert not report.failed, report.summary()
    assert all(r.attempts > 1 for r in report.records[:2]), report.summary()
    branches = {b.name: b.target_commit for b in HfApi().list_repo_refs(REPO).branches}
    assert branches["main"] == branches["task-2"] and {"task-0", "task-1"} <= set(branches)


def test_dropped_requests_still_end_with_every_revision(local_hub, tmp_path):
    local_hub.faults = FaultPlan(drop_every=3)
    learner, _ = _run(tmp_path, backoff=0.01, retries=5)
    assert not learner.push_report.failed, learner.push_report.summary()
    local_hub.faults = FaultPlan()
    branches = {b.name for b in HfApi().list_repo_refs(REPO).branches}
    assert {"main", "task-0", "task-1", "task-2"} <= branches
    assert any(r.status is None for r in local_hub.request_log), "the server did drop requests"


def test_a_hub_that_never_answers_costs_a_bounded_time(local_hub, tmp_path):
    local_hub.faults = FaultPlan(hang_every=1)
    started = time.perf_counter()
    learner, results = _run(tmp_path, timeout=0.5, retries=0)
    elapsed = time.perf_counter() - started
    local_hub.faults = FaultPlan()
    assert results.num_trained == 3
    assert [r.task_index for r in learner.push_report.failed] == [0, 1, 2]
    assert elapsed < 120, elapsed


def test_resume_from_the_hub_after_losing_the_local_folder(local_hub, tmp_path):
    reference_dir = tmp_path / "reference"
    _, expected = _run(reference_dir, repo=None)

    class Crash(TrainerCallback):
        tasks = 0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            Crash.tasks += 1
            if Crash.tasks == 3:
                raise KeyboardInterrupt

    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _run(run_dir, callbacks=[Crash()])
    assert {"task-0", "task-1"} <= {b.name for b in HfApi().list_repo_refs(REPO).branches}
    shutil.rmtree(run_dir)  # the machine is gone; only the Hub is left
    learner, results = _run(run_dir, resume=True)
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=1e-6)
    assert [r.task_index for r in learner.push_report.records] == [2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_push_once_per_revision(local_hub, tmp_path):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()), str(SCRIPT), str(tmp_path), "er", "--hub-model-id", REPO,
    ]
    from test_distributed import user_env  # as a user launches: hf_ccl makes the processes one DDP run itself

    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=user_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "final_results.json").read_text())
    assert payload["pushed"] == [0, 1, 2] and payload["failed"] == []
    assert len(_commits(local_hub)) == 3
    creates = [r for r in local_hub.request_log if r.method == "POST" and r.path.endswith("/branch/task-1")]
    assert len(creates) == 1


def test_trainer_pushes_mid_task_checkpoints_to_the_training_branch(local_hub, tmp_path):
    learner = resumable_run.build_learner(str(tmp_path), ["finetune"], False, REPO, [])
    learner.args.training.update(push_to_hub=True)
    learner.fit()
    files = set(HfApi().list_repo_files(REPO, revision="training"))
    assert "last-checkpoint/trainer_state.json" in files
    assert "last-checkpoint/hf_ccl/method_state.json" in files
    assert "last-checkpoint/hf_ccl/collator_rank0.json" in files


def test_a_token_in_the_config_is_refused(tmp_path):
    from hf_ccl.continual import ContinualArguments

    with pytest.raises(ValueError, match="HF_TOKEN"):
        ContinualArguments(output_dir=str(tmp_path), training={"hub_token": "hf_secret"})


def test_mid_task_resume_from_the_trainer_checkpoint_on_the_hub(local_hub, tmp_path):
    """The machine dies mid-task and its disk is lost: the task resumes from the Trainer's pushed last-checkpoint."""
    reference_dir = tmp_path / "reference"
    _, expected = _run(reference_dir, repo=None)

    class Crash(resumable_run.KillAt):
        def on_save(self, args, state, control, **kwargs):  # noqa: ANN001
            if self.task_seen == self.task and state.global_step >= self.step:
                raise KeyboardInterrupt

    def run(resume: bool, callbacks=()):
        learner = resumable_run.build_learner(str(run_dir), ["er"], resume, REPO, list(callbacks))
        learner.args.training.update(push_to_hub=True, hub_strategy="checkpoint")
        learner.args.keep_trainer_checkpoints = True  # to see below where task 1 resumed from
        return learner, learner.fit()

    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run(False, [Crash([], task=1, step=3)])
    deadline = time.monotonic() + 30  # the Trainer pushes checkpoints in the background (run_as_future)
    while not {"last-checkpoint/hf_ccl/task.json", "last-checkpoint/checkpoint_manifest.json"} <= set(
            HfApi().list_repo_files(REPO, revision="training")):  # pushed with its manifest, to be verified
        assert time.monotonic() < deadline, "the Trainer never pushed its checkpoint"
        time.sleep(0.2)
    shutil.rmtree(run_dir)
    learner, results = run(True)
    assert (run_dir / "trainer" / "task-1" / "checkpoint-hub" / "last-checkpoint").is_dir()
    np.testing.assert_allclose(_matrix(results), _matrix(expected), atol=1e-6)


def test_an_unreachable_hub_loses_nothing_but_the_pushes(tmp_path):
    """Nothing listens at the endpoint: every task still trains, checkpoints stay local, the report lists the pushes."""
    from hf_ccl.testing import local_hub_endpoint

    port = _free_port()  # bound and released: connections are refused
    with local_hub_endpoint(f"http://127.0.0.1:{port}", cache_dir=tmp_path / "cache"):
        learner, results = _run(tmp_path / "run", retries=1, backoff=0.01, timeout=2)
    assert results.num_trained == 3
    assert [r.task_index for r in learner.push_report.failed] == [0, 1, 2]
    assert all("Connect" in r.error or "connect" in r.error for r in learner.push_report.failed), \
        learner.push_report.summary()
    assert all((tmp_path / "run" / f"task-{k}" / "model.safetensors").exists() for k in range(3))


def test_a_cli_run_whose_pushes_fail_exits_1_after_every_checkpoint_then_hf_ccl_push(local_hub, tmp_path, capsys):
    """Every write fails: the run trains every task and writes every checkpoint, then exits 1 naming the revisions
    that are missing and how to push them; `hf-ccl push` pushes them once the Hub is back."""
    from hf_ccl.cli import main

    run_dir = tmp_path / "run"
    local_hub.faults = FaultPlan(fail_every=1)
    code = main(["train", "--config", "digits", f"output_dir={run_dir}", "progress=false", "training.max_steps=2",
                 "training.per_device_train_batch_size=16", "stream_args.max_train_per_task=32",
                 "stream_args.max_eval_per_task=10", "model.config.hidden_size=32", "model.config.num_layers=1",
                 f"hub.model_id={REPO}", "hub.retries=1", "hub.backoff=0.01"])
    captured = capsys.readouterr()
    assert code == 1
    assert all((run_dir / f"task-{k}" / "checkpoint_manifest.json").exists() for k in range(5))
    assert "5 of 5 task revisions were not pushed" in captured.err and f"hf-ccl push {run_dir}" in captured.err
    assert "Hub pushes to" not in captured.out and captured.err.count("hf-ccl: error:") == 1  # reported once
    assert "First error: HfHubHTTPError" in captured.err
    local_hub.faults = FaultPlan()
    assert main(["push", str(run_dir), "--repo", REPO]) == 0
    assert "5/5 task revisions pushed" in capsys.readouterr().out
    branches = {b.name for b in HfApi().list_repo_refs(REPO).branches}
    assert {f"task-{k}" for k in range(5)} <= branches


def test_pushes_whose_replies_were_lost_are_confirmed_on_the_hub(local_hub, tmp_path):
    """Every 2nd write is made and its reply lost: retried writes find nothing to change or a branch that exists.
    The pusher checks the Hub before calling a push failed: every revision holds its task's manifest."""
    from hf_ccl.checkpoint_files import MANIFEST, write_manifest
    from hf_ccl.hub import HubPusher

    folders = []
    for index in range(3):
        folder = tmp_path / f"task-{index}"
        folder.mkdir()
        (folder / "weights.bin").write_bytes(os.urandom(512))
        write_manifest(folder)
        folders.append(folder)
    (folders[2] / "placed-later.txt").write_text("not part of the checkpoint")
    local_hub.faults = FaultPlan(lose_reply_every=2)
    pusher = HubPusher("hf-ccl-test/lost-replies", retries=1, backoff=0.01, timeout=10, background=False)
    for index, folder in enumerate(folders):
        pusher.push(folder, index)
    report = pusher.finish()
    local_hub.faults = FaultPlan()
    assert not report.failed, report.summary()
    for index, folder in enumerate(folders):
        remote = hf_hub_download("hf-ccl-test/lost-replies", MANIFEST, revision=f"task-{index}")
        assert Path(remote).read_bytes() == (folder / MANIFEST).read_bytes()
    files = HfApi().list_repo_files("hf-ccl-test/lost-replies", revision="main")
    assert "placed-later.txt" not in files and "weights.bin" in files
    main_manifest = hf_hub_download("hf-ccl-test/lost-replies", MANIFEST, revision="main")
    assert Path(main_manifest).read_bytes() == (folders[2] / MANIFEST).read_bytes()
