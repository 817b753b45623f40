"""`.eval_results/<benchmark>.yaml`: what is written for a results row (hand-built matrices), and a tiny MTIL run
from the local Hub whose pushed revisions a plain huggingface_hub client (no hf_ccl) parses back to the matrix rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml
from huggingface_hub import EvalResultEntry, HfApi, ModelCard, hf_hub_download, parse_eval_result_entries

from hf_ccl.eval_results import (
    benchmark_file,
    entries_to_text,
    eval_result_entries,
    not_on_the_hub,
    read_eval_results,
    task_datasets,
    write_eval_results,
)
from hf_ccl.evaluation.matrix import ResultsMatrix

REPO = "hf-ccl-test/clip-mtil"
HUB = {"A": {"id": "org/bench", "revision": "a" * 40}, "C": {"id": "org/bench", "revision": "a" * 40},
       "D": {"id": "other/set", "revision": None}}


def _matrix() -> ResultsMatrix:
    matrix = ResultsMatrix(["A", "B", "C", "D"], ["accuracy", "R_mean", "accuracy", "R_mean"])
    matrix.add_row("A", {"A": {"accuracy": 51.123456789012345, "top5": 90.0}, "B": {"R_mean": 3.3},
                         "C": {"accuracy": 1 / 3}, "D": {"R_mean": 12.5}})
    matrix.add_row("B", {}, evaluated=False)
    matrix.add_row("C", {"A": {"accuracy": 40.0}, "C": {"accuracy": 2 / 3}})  # D: no headline in this row
    return matrix


def test_a_row_becomes_one_file_per_hub_dataset_with_one_entry_per_task() -> None:
    files = eval_result_entries(_matrix(), HUB, stream="s", task_index=0, repo_id="me/model")
    assert list(files) == ["org--bench.yaml", "other--set.yaml"] == [benchmark_file("org/bench"),
                                                                     benchmark_file("other/set")]
    bench = files["org--bench.yaml"]
    assert [(e.dataset_id, e.task_id, e.value, e.dataset_revision) for e in bench] == [
        ("org/bench", "A", 51.123456789012345, "a" * 40), ("org/bench", "C", 1 / 3, "a" * 40)]
    assert "task A trained" in bench[0].notes and "task C not trained yet (zero-shot transfer)" in bench[1].notes
    assert "revision task-0: after 1 of 4 tasks" in bench[0].notes and "accuracy in percent" in bench[0].notes
    assert bench[0].source_url == "https://huggingface.co/me/model/blob/task-0/results.json"
    (other,) = files["other--set.yaml"]
    assert (other.task_id, other.value, other.dataset_revision) == ("D", 12.5, None)  # not pinned: no revision
    # B has no Hub dataset: left out, never given an id
    assert not any(e.task_id == "B" for entries in files.values() for e in entries)
    assert eval_result_entries(_matrix(), HUB, stream="s", task_index=1) == {}  # a row not evaluated: no file
    later = eval_result_entries(_matrix(), HUB, stream="s", task_index=2)
    assert list(later) == ["org--bench.yaml"]  # D has no headline in that row: left out
    assert [e.value for e in later["org--bench.yaml"]] == [40.0, 2 / 3] and later["org--bench.yaml"][0].source_url is None


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_headline_that_is_not_finite_is_refused(value: float) -> None:
    matrix = ResultsMatrix(["A", "B"], "accuracy")
    matrix.add_row("A", {"A": {"accuracy": 10.0}, "B": {"accuracy": value}})
    with pytest.raises(ValueError, match=r"task 'B': accuracy after 'A' is .*not a finite number"):
        eval_result_entries(matrix, {"B": {"id": "org/b"}}, stream="s", task_index=0)


def test_a_row_that_is_not_the_checkpoints_task_is_refused() -> None:
    with pytest.raises(ValueError, match="no row after task 3"):
        eval_result_entries(_matrix(), HUB, stream="s", task_index=3)
    matrix = ResultsMatrix(["A", "B"], "accuracy")
    matrix.add_row("B", {"A": {"accuracy": 1.0}})
    with pytest.raises(ValueError, match="row 0 of the results matrix is 'B', not 'A'"):
        eval_result_entries(matrix, {"A": {"id": "org/a"}}, stream="s", task_index=0)


def test_the_yaml_is_the_documented_layout_and_parses_back_exactly() -> None:
    entries = eval_result_entries(_matrix(), HUB, stream="s", task_index=0)["org--bench.yaml"]
    text = entries_to_text(entries)
    data = yaml.safe_load(text)
    assert data[0]["dataset"] == {"id": "org/bench", "task_id": "A", "revision": "a" * 40}
    assert data[0]["value"] == 51.123456789012345
    assert parse_eval_result_entries(data) == entries
    with pytest.raises(ValueError, match="does not read back"):  # the check can fail: NaN never equals itself
        entries_to_text([EvalResultEntry(dataset_id="o/d", task_id="t", value=math.nan)])


def test_state_without_hub_datasets_leaves_every_task_out() -> None:
    old = {"task_names": ["A", "B"]}  # a checkpoint of an earlier hf_ccl
    assert task_datasets(old) == {} and not_on_the_hub(old) == ["A", "B"]
    state = {"task_names": ["A", "B"], "task_datasets": [None, {"id": "o/b", "revision": "r"}]}
    assert task_datasets(state) == {"B": {"id": "o/b", "revision": "r"}} and not_on_the_hub(state) == ["A"]


def test_a_checkpoint_folder_gets_its_files_and_a_card_that_lists_what_is_left_out(tmp_path) -> None:
    from hf_ccl.cards import build_model_card

    matrix = ResultsMatrix(["A", "B"], "accuracy")
    matrix.add_row("A", {"A": {"accuracy": 12.5}, "B": {"accuracy": 37.5}})
    matrix.save(tmp_path)
    state = {"task_index": 0, "task_names": ["A", "B"], "stream": "s",
             "task_datasets": [None, {"id": "org/b", "revision": "r" * 40}]}
    (tmp_path / "continual_state.json").write_text(json.dumps(state), encoding="utf-8")
    (tmp_path / ".eval_results").mkdir()
    (tmp_path / ".eval_results" / "stale.yaml").write_text("[]", encoding="utf-8")  # from an earlier write
    assert [p.name for p in write_eval_results(tmp_path)] == ["org--b.yaml"]
    (entry,) = read_eval_results(tmp_path)["org--b.yaml"]
    assert (entry.task_id, entry.value, entry.dataset_revision) == ("B", 37.5, "r" * 40)
    assert sorted(read_eval_results(tmp_path)) == ["org--b.yaml"]
    text = build_model_card(tmp_path).text
    assert "- `org--b.yaml` (`org/b` at `rrrrrrrrrr`): B" in text
    assert "- Left out (bundled or local data, with no Hub dataset to name): A." in text
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    results["rows"][0]["metrics"]["B"]["accuracy"] = None  # how results.json keeps a NaN
    (tmp_path / "results.json").write_text(json.dumps(results), encoding="utf-8")
    with pytest.raises(ValueError, match="task 'B': accuracy after 'A' is nan, not a finite number"):
        write_eval_results(tmp_path)
    assert sorted(read_eval_results(tmp_path)) == ["org--b.yaml"]  # refused before anything was written
    state["task_datasets"] = [None, None]
    (tmp_path / "continual_state.json").write_text(json.dumps(state), encoding="utf-8")
    assert write_eval_results(tmp_path) == [] and read_eval_results(tmp_path) == {}
    assert "No `.eval_results/` file" in build_model_card(tmp_path).text


def _parquet(rows: int) -> bytes:
    import io

    from datasets import ClassLabel, Dataset, Features, Image
    from PIL import Image as PILImage

    images = []
    for index in range(rows):
        buffer = io.BytesIO()
        PILImage.new("RGB", (8, 8), (index * 20, 0, 0)).save(buffer, format="PNG")
        images.append({"bytes": buffer.getvalue(), "path": None})
    features = Features({"image": Image(), "label": ClassLabel(names=["a", "b"])})
    buffer = io.BytesIO()
    Dataset.from_dict({"image": images, "label": [i % 2 for i in range(rows)]}, features=features).to_parquet(buffer)
    return buffer.getvalue()


def test_tasks_name_a_hub_id_source_and_nothing_else(local_hub, tmp_path, monkeypatch) -> None:
    """A task read from a Hub dataset id names it (read at its default branch: no revision); a local one does not."""
    import datasets

    from hf_ccl.data import build_stream
    from hf_ccl.data.builders import TaskSource, stream_from_datasets
    from hf_ccl.data.task import Task

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    local_hub.store.create_repo("dataset", "hf-ccl-test/tiny")
    local_hub.store.commit("dataset", "hf-ccl-test/tiny", "main", [
        ("add", "data/train-00000-of-00001.parquet", _parquet(6)),
        ("add", "data/test-00000-of-00001.parquet", _parquet(4))], "data")
    (task,) = stream_from_datasets([TaskSource(name="t", train="hf-ccl-test/tiny", label_column="label")], name="x")
    assert (task.dataset_id, task.dataset_revision) == ("hf-ccl-test/tiny", None)
    assert build_stream("digits", max_train_per_task=4, max_eval_per_task=4)[0].dataset_id is None
    with pytest.raises(ValueError, match="dataset_revision 'abc' without a dataset_id"):
        Task(name="t", train=task.train, eval=task.eval, kind="classification", class_names=["a", "b"],
             dataset_revision="abc")
    with pytest.raises(ValueError, match="dataset_id must be a Hub dataset id"):
        Task(name="t", train=task.train, eval=task.eval, kind="classification", class_names=["a", "b"],
             dataset_id="not an id")


# ----- a tiny MTIL run from the local Hub, pushed, read back by a plain client -----------------------------------
#: Two stand-ins for MTIL repos (classes, eval rows), so that the two tasks' scores differ.
FAKE = {"CIFAR100": (["apple", "bear", "cat", "dog"], 8), "MNIST": (["0", "1", "2"], 6)}

READ_BACK = r"""
import json, sys
import yaml
from huggingface_hub import HfApi, hf_hub_download, parse_eval_result_entries
repo, out = sys.argv[1], {}
for revision in sys.argv[2:]:
    entries = []
    for name in sorted(HfApi().list_repo_files(repo, revision=revision)):
        if name.startswith(".eval_results/") and name.endswith(".yaml"):
            with open(hf_hub_download(repo, name, revision=revision), encoding="utf-8") as handle:
                entries += [(name, e.dataset_id, e.dataset_revision, e.task_id, e.value, e.notes)
                            for e in parse_eval_result_entries(yaml.safe_load(handle))]
    out[revision] = entries
assert not any(module.split(".")[0] == "hf_ccl" for module in sys.modules)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def mtil_run(tmp_path_factory, shared_data_root):
    """`hf-ccl train` on MTIL's CIFAR100 and MNIST read from the local Hub (tiny stand-in repos, pinned at one
    commit each), pushed to REPO: (server, run folder, commits of the dataset repos)."""
    import datasets
    from test_classification_streams import _cifar_images, _push, _wds_files

    from hf_ccl.cli import main
    from hf_ccl.data.mtil import MTIL_REPOS
    from hf_ccl.testing import LocalHubServer

    tmp = tmp_path_factory.mktemp("mtil-run")
    images = _cifar_images(shared_data_root, 8)
    cache = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp / "datasets")  # the stand-in repos' Arrow files: not the user's cache
    try:
        with LocalHubServer(tmp / "hub") as server, server.patch_client(cache_dir=tmp / "hf-cache"):
            commits = {name: _push(server.store, MTIL_REPOS[name],
                                   _wds_files(images, classes, {"train": 8, "test": rows}, per_shard=8))
                       for name, (classes, rows) in FAKE.items()}
            run_dir = tmp / "run"
            code = main(["train", "--config", "digits", f"output_dir={run_dir}", "progress=false", "stream=mtil",
                         "stream_args.datasets=[CIFAR100,MNIST]", "training.max_steps=2",
                         "training.per_device_train_batch_size=8", "model.config.hidden_size=32",
                         "model.config.num_layers=1", f"hub.model_id={REPO}"])
            assert code == 0
            yield server, run_dir, commits
    finally:
        datasets.config.HF_DATASETS_CACHE = cache


def test_pushed_revisions_parse_back_to_their_results_rows_without_hf_ccl(mtil_run) -> None:
    _, run_dir, commits = mtil_run
    from hf_ccl.data.mtil import MTIL_REPOS

    revisions = ["task-0", "task-1", "main"]
    result = subprocess.run([sys.executable, "-c", READ_BACK, REPO, *revisions], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    matrix = ResultsMatrix.load(run_dir)
    assert matrix.headline_metrics == ["accuracy", "accuracy"]
    for index, revision in enumerate(revisions):
        row = matrix.rows[min(index, 1)]  # main follows the newest task
        expected = sorted((f".eval_results/{benchmark_file(MTIL_REPOS[task])}", MTIL_REPOS[task], commits[task], task,
                           row.metrics[task]["accuracy"]) for task in matrix.task_names)
        assert sorted(tuple(entry[:5]) for entry in found[revision]) == expected, revision
    notes = {revision: {entry[3]: entry[5] for entry in found[revision]} for revision in revisions}
    assert "revision task-0: after 1 of 2 tasks" in notes["task-0"]["MNIST"]
    assert "task MNIST not trained yet (zero-shot transfer)" in notes["task-0"]["MNIST"]
    assert "task MNIST trained" in notes["task-1"]["MNIST"] and notes["main"] == notes["task-1"]


def test_the_checkpoint_card_and_model_index_name_the_hub_datasets(mtil_run) -> None:
    _, run_dir, commits = mtil_run
    from hf_ccl.data.mtil import MTIL_REPOS

    local = read_eval_results(run_dir / "task-0")
    assert sorted(local) == sorted(benchmark_file(MTIL_REPOS[task]) for task in FAKE)
    assert write_eval_results(run_dir / "task-0", repo_id=REPO) and read_eval_results(run_dir / "task-0") == local
    card = ModelCard.load(hf_hub_download(REPO, "README.md", revision="task-0"))
    assert "`clip-benchmark--wds_mnist.yaml` (`clip-benchmark/wds_mnist` at" in card.text
    (result,) = card.data.eval_results  # the legacy format: the trained task only
    assert (result.dataset_type, result.dataset_config, result.dataset_revision) == (
        MTIL_REPOS["CIFAR100"], "CIFAR100", commits["CIFAR100"])
    assert set(card.data.datasets) == {MTIL_REPOS[task] for task in FAKE}


def test_a_push_whose_eval_results_are_damaged_sends_nothing_and_exits_1(mtil_run, tmp_path, capsys) -> None:
    """`hf-ccl push` verifies every file the manifest lists, `.eval_results/` included, before it sends anything."""
    import shutil

    from hf_ccl.cli import main

    server, run_dir, _ = mtil_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (path,) = (copy / "task-1" / ".eval_results").glob("*mnist.yaml")
    path.write_text(path.read_text(encoding="utf-8").replace("value: ", "value: 9"), encoding="utf-8")
    before = len(server.request_log)
    assert main(["push", str(copy), "--repo", "hf-ccl-test/other"]) == 1
    err = capsys.readouterr().err
    assert err.count("hf-ccl: error:") == 1 and "clip-benchmark--wds_mnist.yaml" in err
    assert not any(r.method == "POST" for r in server.request_log[before:])
    assert not HfApi().repo_exists("hf-ccl-test/other")
