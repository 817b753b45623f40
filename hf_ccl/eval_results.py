"""A task revision's results the way the Hub reads them now: `.eval_results/<benchmark>.yaml` files.

Since December 2025 the Hub reads evaluation scores from YAML files in a model repo's `.eval_results/` folder
(huggingface_hub's `EvalResultEntry`; the card's `model-index`, written by `hf_ccl.cards`, is the legacy format and is
still written). Each task checkpoint (`task-<k>/`, pushed as revision `task-<k>`) holds:

- one file per *benchmark*, a Hub dataset that a task of the stream is evaluated on (`Task.dataset_id`, e.g. an MTIL
  task's `clip-benchmark/wds_*` repo): `.eval_results/<owner>--<name>.yaml`;
- in it, one entry per task of that dataset: `task_id` the task's name, `value` the task's headline metric (percent)
  in the results matrix row of this revision (after task k), for trained tasks and tasks not trained yet (zero-shot
  transfer) alike, so that the files hold the row exactly; `dataset.revision` the commit the stream read (when it
  pinned one); `notes` the stream, the revision, whether the task was trained, the metric and the eval rows;
  `source` the revision's `results.json` (the whole matrix) when the repository is known.

Tasks whose data are bundled, local or in memory have no Hub dataset: they are left out and the card lists them
(`not_on_the_hub`); no id is ever made up. A revision whose row was not evaluated (`evaluation.every`) gets no file;
a task without a headline in the row is left out; a headline that is not a finite number is refused (ValueError).
Every file is parsed back with huggingface_hub's own parser before it counts as written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from huggingface_hub import EvalResultEntry, eval_result_entries_to_yaml, parse_eval_result_entries
from huggingface_hub.constants import EVAL_RESULTS_FOLDER

from .callbacks import StreamControl, StreamState, TaskCallback
from .evaluation.matrix import ResultsMatrix
from .files import write_text_atomic
from .hub import TASK_BRANCH

if TYPE_CHECKING:
    from .arguments import ContinualArguments

STATE_FILE = "continual_state.json"  # hf_ccl.continual.CHECKPOINT_STATE
#: What each headline metric of the results matrix is, for the entries' notes.
HEADLINE_DESCRIPTIONS = {
    "accuracy": "zero-shot top-1 accuracy among the task's classes",
    "seen_accuracy": "zero-shot top-1 accuracy among the classes of every task trained so far",
    "all_accuracy": "zero-shot top-1 accuracy among the classes of every task of the stream (X-TAIL)",
    "R_mean": "mean of Recall@1/5/10, image-to-text and text-to-image",
    "R@1": "Recall@1, mean of both directions",
}


def benchmark_file(dataset_id: str) -> str:
    """The file of a benchmark dataset in `.eval_results/`: `owner/name` -> `owner--name.yaml`."""
    return dataset_id.replace("/", "--") + ".yaml"


def task_datasets(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: {"id", "revision"}} of the tasks whose eval data come from a Hub dataset (`continual_state.json`'s
    `task_datasets`; a checkpoint written before them has none)."""
    names = list(state.get("task_names") or [])
    datasets = state.get("task_datasets") or [None] * len(names)
    return {name: dict(dataset) for name, dataset in zip(names, datasets, strict=True) if dataset}


def not_on_the_hub(state: Mapping[str, Any]) -> list[str]:
    """The tasks left out of `.eval_results` because their data have no Hub dataset (bundled, local, in memory)."""
    hub = task_datasets(state)
    return [name for name in state.get("task_names") or [] if name not in hub]


def _notes(matrix: ResultsMatrix, stream: str, index: int, position: int, metric: str) -> str:
    task = matrix.task_names[position]
    examples = ((matrix.evaluation or {}).get("examples") or {}).get(task, {}).get("evaluated")
    trained = "trained" if position <= index else "not trained yet (zero-shot transfer)"
    parts = [f"hf_ccl continual run, stream {stream}, revision {TASK_BRANCH.format(index=index)}: after "
             f"{index + 1} of {matrix.num_tasks} tasks; task {task} {trained}",
             f"{metric} in percent ({HEADLINE_DESCRIPTIONS.get(metric, 'the task kind headline metric')})"]
    if examples is not None:
        parts.append(f"{examples} eval examples")
    return "; ".join(parts)


def eval_result_entries(
    matrix: ResultsMatrix,
    datasets: Mapping[str, Mapping[str, Any]],
    *,
    stream: str,
    task_index: int,
    repo_id: str | None = None,
) -> dict[str, list[EvalResultEntry]]:
    """{file name: entries} for the row of `matrix` after task `task_index` (see the module docstring): one file
    per Hub dataset in `datasets` ({task: {"id", "revision"}}), one entry per task of it with a headline in that
    row. Empty when the row was not evaluated. Raises ValueError for a headline that is not a finite number."""
    if not 0 <= task_index < len(matrix.rows):
        raise ValueError(f"the results matrix has {len(matrix.rows)} trained rows: no row after task {task_index}")
    row = matrix.rows[task_index]
    if row.label != matrix.task_names[task_index]:
        raise ValueError(f"row {task_index} of the results matrix is {row.label!r}, not "
                         f"{matrix.task_names[task_index]!r}: the checkpoint's results and state disagree")
    files: dict[str, list[EvalResultEntry]] = {}
    if not row.evaluated:
        return files
    source = None if repo_id is None else \
        f"https://huggingface.co/{repo_id}/blob/{TASK_BRANCH.format(index=task_index)}/results.json"
    for position, (task, metric) in enumerate(zip(matrix.task_names, matrix.headline_metrics, strict=True)):
        cell = row.metrics.get(task, {})
        if task not in datasets or metric not in cell:
            continue
        value = cell[metric]
        if not math.isfinite(value):
            raise ValueError(f"task {task!r}: {metric} after {row.label!r} is {value}, not a finite number; "
                             f".eval_results refuses it (was the evaluation cut short?)")
        dataset = datasets[task]
        files.setdefault(benchmark_file(dataset["id"]), []).append(EvalResultEntry(
            dataset_id=dataset["id"], task_id=task, value=value, dataset_revision=dataset.get("revision"),
            source_url=source, source_name=None if source is None else "hf_ccl results matrix (results.json)",
            notes=_notes(matrix, stream, task_index, position, metric)))
    return files


def entries_to_text(entries: Sequence[EvalResultEntry]) -> str:
    """A `.eval_results` file's text, checked: huggingface_hub's parser reads back exactly `entries`."""
    text = yaml.safe_dump(eval_result_entries_to_yaml(list(entries)), sort_keys=False, allow_unicode=True,
                          width=1000)
    if parse_eval_result_entries(yaml.safe_load(text)) != list(entries):
        raise ValueError(f"huggingface_hub does not read back the .eval_results entries written: {text}")
    return text


def read_eval_results(folder: str | Path) -> dict[str, list[EvalResultEntry]]:
    """{file name: entries} of `folder/.eval_results/*.yaml`, parsed by huggingface_hub's parser."""
    found = {}
    for path in sorted((Path(folder) / EVAL_RESULTS_FOLDER).glob("*.yaml")):
        found[path.name] = parse_eval_result_entries(yaml.safe_load(path.read_text(encoding="utf-8")) or [])
    return found


def write_eval_results(checkpoint_dir: str | Path, repo_id: str | None = None) -> list[Path]:
    """Write `.eval_results/<benchmark>.yaml` into a task checkpoint folder from its `continual_state.json` and
    `results.json` (files it wrote before are removed); the paths written."""
    folder = Path(checkpoint_dir)
    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    files = eval_result_entries(ResultsMatrix.load(folder), task_datasets(state), stream=str(state.get("stream")),
                                task_index=int(state["task_index"]), repo_id=repo_id)
    texts = {name: entries_to_text(entries) for name, entries in files.items()}  # every check before any write
    target = folder / EVAL_RESULTS_FOLDER
    for stale in target.glob("*.yaml"):
        stale.unlink()
    if texts:
        target.mkdir(exist_ok=True)
    return [write_text_atomic(target / name, text) for name, text in texts.items()]


class EvalResultsCallback(TaskCallback):
    """Writes `.eval_results/` into every task checkpoint, from its files (before the manifest: pushed with it)."""

    def on_save(self, args: ContinualArguments, state: StreamState, control: StreamControl, **kwargs: Any) -> None:
        if kwargs["task_folder"]:
            write_eval_results(kwargs["folder"], repo_id=args.hub.model_id)
