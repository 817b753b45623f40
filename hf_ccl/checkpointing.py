"""Task checkpoints: writing `output_dir/task-<k>/` and resuming a run from one (local, or the Hub's newest `task-<k>`
revision), and the interrupted task's own Trainer checkpoint.

A task checkpoint is a run's `RunState` (`hf_ccl.run_state`) with its model and processor: the model, the processor
and tokenizer, every method's and task callback's state (one state protocol, `save_states` / `restore_states`), the
results so far, `continual_state.json`, and the callbacks' files for readers (compute, spatial disorder, the model
card); `checkpoint_manifest.json` comes last (a folder without it was cut short) and is verified on resume. A resume
must match the saved settings (`resume_allow_changes` lets named changes through, and records them).

Every function here takes what it reads and writes as arguments (the run state, the model, paths, settings): none
knows the learner.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .callbacks import (
    CALLBACK_STATE,
    TaskCallback,
    load_callback_states,
    save_callback_states,
    stateful_callbacks,
)
from .checkpoint_files import (
    MANIFEST,
    CheckpointError,
    checkpoint_is_complete,
    manifest_view,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from .class_prompts import scope_class_names
from .compute import compute_state
from .data.collate import load_tokenizer
from .data.task import TaskStream
from .distributed import barrier, broadcast_object, is_main_process
from .evaluation.matrix import ResultsMatrix
from .evaluation.spatial_disorder import disorder_state
from .evaluation.zeroshot import DEFAULT_TEMPLATES
from .hub import bounded_hub_timeouts, download_task_checkpoint, task_branches
from .methods.base import ContinualMethod
from .methods.state import load_method_states, save_method_states
from .modeling import ContinualDualEncoder
from .processors import save_processor
from .resume_settings import UNCOMPARED_TRAINING, allowed, describe_diff, settings_diff
from .run_state import RunState
from .tokenization import position_table_path, resize_position_embeddings
from .trainer import MID_TASK_STATE
from .validation import ConfigError
from .version import __version__

logger = logging.getLogger(__name__)

CHECKPOINT_STATE = "continual_state.json"

#: Writes the task callbacks' files for readers into a folder (`folder`, `task_folder`): the `on_save` event.
WriteOutputs = Callable[[Path, bool], None]


# ----- resume ------------------------------------------------------------------------------------------------------
def find_resume_checkpoint(request: bool | str | None, output_dir: Path, hub_model_id: str | None = None,
                           hub_timeout: float = 60.0) -> Path | None:
    """The task checkpoint folder `request` (`resume_from_checkpoint`) continues from: in `output_dir`, else the
    newest `task-<k>` revision of `hub_model_id`; None to start from the first task."""
    if request in (None, False):
        return None
    if isinstance(request, str) and request != "auto":
        path = Path(request)
        if (path / CHECKPOINT_STATE).exists():
            return path
        found = latest_task_checkpoint(path)
        if found is None:
            raise ValueError(f"resume_from_checkpoint={request!r}: no complete task checkpoint (a task-<k>/ folder "
                             f"with {CHECKPOINT_STATE}) there")
        return found
    found = latest_task_checkpoint(output_dir)
    if found is None and hub_model_id is not None:
        found = download_latest_from_hub(hub_model_id, output_dir, hub_timeout)
    if found is None and request is True and broadcast_object(
            newest_complete_trainer_checkpoint(output_dir / "trainer" / "task-0") if is_main_process() else None):
        logger.info("No task checkpoint yet in %s: task 0 resumes from its Trainer checkpoint", output_dir)
        return None
    if found is None and request is True:
        where = str(output_dir) + (f" or on the Hub at {hub_model_id}" if hub_model_id else "")
        raise ValueError(f"resume_from_checkpoint=True but there is no complete task checkpoint in {where}; use "
                         "'auto' to start afresh when there is none")
    return found


def download_latest_from_hub(repo: str, output_dir: Path, hub_timeout: float = 60.0) -> Path | None:
    """Fetch the newest `task-<k>` revision of `repo` into `output_dir` (main process; others wait)."""
    bounded_hub_timeouts(hub_timeout)  # the download gets bounded timeouts too
    branches = task_branches(repo)
    if not branches:
        return None
    index = max(branches)
    folder = output_dir / f"task-{index}"
    if is_main_process():
        logger.info("Resuming from %s revision task-%d", repo, index)
        download_task_checkpoint(repo, index, folder)
    barrier()
    if not (folder / CHECKPOINT_STATE).exists():
        raise ValueError(f"Revision task-{index} of {repo} has no {CHECKPOINT_STATE}: not an hf_ccl task checkpoint")
    return folder  # verified by `restore`, like a local one


def restore(folder: str | Path, run: RunState, model: ContinualDualEncoder, task_names: list[str]) -> int:
    """Load a task checkpoint written by `save_checkpoint` into `run` and `model`: model weights, tokenizer (if it
    changed), every method's and task callback's state, the results so far, the global step and the resume changes
    (the checkpoint must be of a stream of `task_names`, with `run`'s methods and settings). Returns the index of the
    task it was written after. Every problem is an error naming the file, never a silent fresh start."""
    folder = Path(folder)
    try:
        extra = verify_checkpoint(folder)
    except CheckpointError as error:
        raise CheckpointError(f"{error}. Remove {folder} to resume from the task before it, or restore the "
                              "file") from error
    with manifest_view(folder, extra) as view:  # only the files the checkpoint wrote are read
        return _restore_verified(view, folder, run, model, task_names)


def _restore_verified(folder: Path, source: Path, run: RunState, model: ContinualDualEncoder,
                      task_names: list[str]) -> int:
    """`restore` of a verified checkpoint read from `folder` (`source` itself, or a view of its listed files)."""
    state = _read_json(folder / CHECKPOINT_STATE)
    index = int(state["task_index"])
    if state.get("task_names") != task_names:
        raise ValueError(f"{source / CHECKPOINT_STATE} was written for tasks {state.get('task_names')}, but this "
                         f"stream has {task_names}: resume with the same stream")
    methods = [method.name for method in run.methods]
    if state.get("methods") != methods:
        raise ValueError(f"{source / CHECKPOINT_STATE} was written with methods {state.get('methods')}, but this "
                         f"run has {methods}: resume with the same methods")
    check_settings(run, state, source / CHECKPOINT_STATE, index)
    check_same_architecture(model.config, folder, source)
    tokenizer_file = folder / "tokenizer_config.json"
    if tokenizer_file.exists():
        saved = load_tokenizer(folder)
        if not same_tokenizer(saved, run.tokenizer):  # by content: grown merges need not add tokens
            run.tokenizer = saved
    load_model_weights(model, folder)
    model.align_special_tokens(run.tokenizer)
    restore_states(folder, run.methods, run.callbacks)
    try:
        run.results = ResultsMatrix.load(folder)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"Cannot read the results matrix in {source}: {error}") from error
    # (checkpoints written before `global_step` was stored: their compute records hold every task's steps)
    run.global_step = int(state["global_step"] if "global_step" in state else
                          sum(task["optimizer_steps"] for task in compute_state(folder)["tasks"]))
    trained = [row.label for row in run.results.rows if row.label != "initial"]
    if len(trained) != index + 1:
        raise ValueError(f"{source} holds {len(trained)} trained rows in results.json, expected {index + 1}")
    logger.info("Resumed after task %d (%s) from %s", index, state.get("task_name"), source)
    return index


#: Config values that fix the shapes of a model's weights: a resumed run must build the model the checkpoint holds.
ARCHITECTURE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                     "image_size", "patch_size", "num_patches", "projection_dim")


def check_same_architecture(config: PretrainedConfig, folder: Path, source: Path | None = None) -> None:
    """Refuse, before any weight is read, a checkpoint whose `config.json` is another family (`model_type`) or another
    size (`ARCHITECTURE_KEYS`, top level and per tower) than the model this run built. The vocabulary and the text
    context may differ: a checkpoint grown by `grow_vocab` regrows the model as it loads. `source`: the folder to
    name (when `folder` is a view of it)."""
    saved, now = _read_json(folder / "config.json"), config.to_dict()
    folder = source or folder
    if saved.get("model_type") != now.get("model_type"):
        raise ConfigError(f"{folder} holds a model of family {saved.get('model_type')!r}, but this run builds one of "
                          f"family {now.get('model_type')!r}: resume with the family the run started with "
                          f"(model.family={saved.get('model_type')}), or start afresh in another output_dir",
                          "model.family")
    changed = []
    for section in ("", "text_config", "vision_config"):
        old, new = (saved, now) if not section else (saved.get(section) or {}, now.get(section) or {})
        changed += [f"{section + '.' if section else ''}{key} {old[key]} -> {new[key]}" for key in ARCHITECTURE_KEYS
                    if key in old and key in new and old[key] != new[key]]
    if changed:
        raise ConfigError(f"{folder} holds a model of another size than this run builds (saved -> now: "
                          f"{', '.join(changed)}): resume with the model settings the run started with (model.config, "
                          "model.pretrained), or start afresh in another output_dir", "model")


def same_tokenizer(one: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase) -> bool:
    """Same vocabulary, merges, added tokens and settings: the serialised backends of fast tokenizers (without the
    padding and truncation the last call left set), else the vocabularies and BPE ranks; and the same
    `model_max_length`."""
    if one.model_max_length != other.model_max_length:
        return False
    one_backend, other_backend = (getattr(tokenizer, "backend_tokenizer", None) for tokenizer in (one, other))
    if one_backend is not None and other_backend is not None:
        first, second = (json.loads(backend.to_str()) for backend in (one_backend, other_backend))
        for data in (first, second):
            data.pop("padding", None)
            data.pop("truncation", None)
        return first == second
    return (type(one) is type(other) and one.get_vocab() == other.get_vocab()
            and getattr(one, "bpe_ranks", None) == getattr(other, "bpe_ranks", None))


def mid_task_checkpoint(request: bool | str | None, training_args: TrainingArguments, task_index: int,
                        run: RunState) -> str | None:
    """The interrupted task's last Trainer checkpoint when resuming (`request`: `resume_from_checkpoint`; it needs
    `save_strategy`): the local one, else (with `training.push_to_hub`) the `last-checkpoint/` the Trainer pushed
    to the `training` branch, when it belongs to this task. Its settings are checked against `run`'s. None: the
    task starts from its beginning."""
    if request in (None, False):
        return None
    trainer_dir = Path(str(training_args.output_dir))
    found = cast("str | None", broadcast_object(newest_complete_trainer_checkpoint(trainer_dir)
                                                if is_main_process() else None))
    if found is None and training_args.push_to_hub:
        found = download_training_checkpoint(training_args, trainer_dir, task_index)
    if found is not None:
        task = _read_json(Path(found) / MID_TASK_STATE / "task.json")
        if task.get("task_index") != task_index:
            raise ValueError(f"Trainer checkpoint {found} was written during task {task.get('task_index')}, not "
                             f"task {task_index}")
        if "settings" in task:
            check_settings(run, task, Path(found) / MID_TASK_STATE / "task.json", task_index - 1)
    return found


def download_training_checkpoint(training_args: TrainingArguments, trainer_dir: Path, task_index: int) -> str | None:
    """Fetch `last-checkpoint/` from the Trainer's Hub branch into trainer_dir (main process; others wait); None
    when there is none or it was written during another (earlier) task."""
    target = trainer_dir / "checkpoint-hub"
    if is_main_process() and training_args.hub_model_id is not None:
        try:
            snapshot_download(training_args.hub_model_id, revision=training_args.hub_revision,
                              allow_patterns=["last-checkpoint/*"], local_dir=str(target))
        except (RepositoryNotFoundError, RevisionNotFoundError):
            pass
    barrier()
    folder = target / "last-checkpoint"
    if not (folder / MID_TASK_STATE).is_dir():
        return None
    try:  # the manifest the Trainer pushed with it (`ContinualTrainer._push_from_checkpoint`)
        verify_checkpoint(folder)
    except CheckpointError as error:
        logger.warning("The Trainer checkpoint on the Hub is damaged (%s): task %d starts from its beginning",
                       error, task_index)
        return None
    task = _read_json(folder / MID_TASK_STATE / "task.json").get("task_index")
    return str(folder) if task == task_index else None


def check_settings(run: RunState, saved: dict[str, Any], source: Path, after_task: int) -> None:
    """Refuse a resume whose settings differ from those `saved` (a checkpoint's state), except the keys of
    `run.allow_changes` (`resume_allow_changes`), which are recorded in `run.resume_changes`. Checkpoints without
    `settings` (older hf_ccl) are compared on the keys they stored."""
    settings = saved.get("settings")
    if settings is None:
        legacy = {"seed": saved.get("seed"), "methods": saved.get("methods"),
                  "method_args": saved.get("method_configs"), "first_task_epochs": saved.get("first_task_epochs"),
                  "training": {k: v for k, v in (saved.get("training") or {}).items()
                               if k in run.settings["training"] or k not in UNCOMPARED_TRAINING}}
        settings = {key: value for key, value in legacy.items() if key in saved or key == "method_args"}
        now = {key: run.settings[key] for key in settings}
    else:
        now = run.settings
    changes = settings_diff(settings, now)
    refused = [change for change in changes if not allowed(change[0], run.allow_changes)]
    if refused:
        described, keys = describe_diff(refused)
        raise ConfigError(
            f"{source} was written with other settings than this run's (saved -> now): {described}. Resume with "
            f"the same settings, or allow these changes with resume_allow_changes=[{', '.join(keys)}]",
            "resume_from_checkpoint")
    run.resume_changes = list(saved.get("resume_changes", []))
    recorded = {(change["key"], json.dumps(change["now"])) for change in run.resume_changes}
    for key, old, new in changes:
        if (key, json.dumps(new)) not in recorded:
            run.resume_changes.append({"after_task": after_task, "key": key, "saved": old, "now": new})
            where = f"after task {after_task}" if after_task >= 0 else "in task 0 (from its Trainer checkpoint)"
            logger.warning("Resuming %s with %s changed: %r -> %r (allowed)", where, key, old, new)


# ----- writing -----------------------------------------------------------------------------------------------------
def save_run_files(output_dir: Path, results: ResultsMatrix, write_outputs: WriteOutputs) -> None:
    """The run folder's results (and, through `write_outputs`, the callbacks' files: compute, disorder), as in the
    last task checkpoint (main process)."""
    if is_main_process():
        results.save(output_dir)
        write_outputs(output_dir, False)


def save_checkpoint(output_dir: Path, index: int, run: RunState, model: ContinualDualEncoder, image_processor: Any,
                    stream: TaskStream, max_length: int, write_outputs: WriteOutputs) -> Path:
    """Write `output_dir/task-<index>/` atomically (a `.partial` folder renamed at the end; main process only): the
    model, its processor (`max_length`), `run`'s states and results, `continual_state.json` (with what the card
    says of `stream`), the callbacks' files (`write_outputs`) and, last, the manifest; then the run folder's files
    (`save_run_files`)."""
    final = output_dir / f"task-{index}"
    if is_main_process():
        partial = output_dir / f"task-{index}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        model.save_pretrained(partial)
        # the family's processor, padding as hf_ccl did (plain clients reproduce the evaluation: hf_ccl.processors)
        save_processor(partial, model, image_processor, run.tokenizer, max_length)
        save_states(partial, run.methods, run.callbacks)
        run.results.save(partial)
        state = checkpoint_state(index, run, stream)
        (partial / CHECKPOINT_STATE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        write_outputs(partial, True)  # compute, disorder, the model card
        write_manifest(partial)  # last: a folder without it was cut short
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    save_run_files(output_dir, run.results, write_outputs)
    barrier()
    return final


def checkpoint_state(index: int, run: RunState, stream: TaskStream) -> dict[str, Any]:
    """`continual_state.json` of the checkpoint after task `index`: where the run is, what a resume must match, and
    what the model card reads."""
    description = run.description
    return {
        "task_index": index,
        "task_name": stream[index].name,
        "stream": stream.name,
        "task_names": stream.task_names,
        "task_sources": [task.source for task in stream],
        "task_datasets": [None if task.dataset_id is None else {"id": task.dataset_id, "revision": task.dataset_revision}
                          for task in stream],
        "methods": [method.name for method in run.methods],
        "method_configs": {method.name: method.config.to_dict() for method in run.methods},
        "base_model": description.get("base_model"),
        "seed": description.get("seed"),
        "training": description.get("training"),
        "first_task_epochs": description.get("first_task_epochs"),
        "global_step": run.global_step,
        "hf_ccl_version": __version__,
        "settings": run.settings,
        "resume_changes": run.resume_changes,
        "card_license": description.get("card_license"),
        "class_scope": description.get("class_scope", "task"),
        "evaluation": [evaluation_protocol(task, stream, index + 1, description.get("class_scope", "task"))
                       for task in stream],
    }


# ----- state (methods and task callbacks, one protocol) -------------------------------------------------------------
#: Where checkpoints written before the task callbacks' state protocol (no `callback_state.json`) kept the built-in
#: callbacks' state, by `state_key`: read from those files on resume.
LEGACY_CALLBACK_STATES: dict[str, Callable[[Path], dict[str, Any]]] = {
    "compute": compute_state,
    "spatial_disorder": disorder_state,
}


def save_states(folder: Path, methods: Sequence[ContinualMethod], callbacks: Sequence[TaskCallback]) -> None:
    """Every method's and every stateful task callback's `state_dict()` in `folder` (`hf_ccl.state_files`)."""
    save_method_states(list(methods), folder)
    save_callback_states(callbacks, folder)


def restore_states(folder: Path, methods: Sequence[ContinualMethod], callbacks: Sequence[TaskCallback]) -> None:
    """Give every method and stateful task callback its state saved by `save_states` in `folder`. A checkpoint of an
    earlier hf_ccl (without `callback_state.json`): the built-in callbacks' state is read from their files
    (`LEGACY_CALLBACK_STATES`); other callbacks start afresh, with a warning."""
    load_method_states(list(methods), folder)
    if (folder / f"{CALLBACK_STATE}.json").is_file():
        load_callback_states(callbacks, folder)
        return
    for key, callback in stateful_callbacks(callbacks).items():
        read = LEGACY_CALLBACK_STATES.get(key)
        if read is None:
            logger.warning("%s has no %s.json (written by an earlier hf_ccl): task callback %r starts from its "
                           "initial state", folder, CALLBACK_STATE, key)
        else:
            callback.load_state_dict(read(folder))


# ----- files ----------------------------------------------------------------------------------------------------
def latest_task_checkpoint(run_dir: str | Path, warn: bool = True) -> Path | None:
    """The complete `task-<k>/` folder (with `continual_state.json` and its manifest, which is written last) with
    the highest k in `run_dir`, or None. `.partial` folders (a save that was interrupted) are ignored; a newer
    folder without its manifest was cut short or copied in part and is skipped (with a warning when `warn`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    found = []
    for child in run_dir.iterdir():
        name = child.name
        if child.is_dir() and name.startswith("task-") and name[5:].isdigit():
            found.append((int(name[5:]), child))
    for _, child in sorted(found, reverse=True):
        if (child / CHECKPOINT_STATE).is_file() and (child / MANIFEST).is_file():
            return child
        if warn:
            logger.warning("Task checkpoint %s is incomplete (no %s: cut short or copied in part): not used",
                           child, MANIFEST if (child / CHECKPOINT_STATE).is_file() else CHECKPOINT_STATE)
    return None



def evaluation_protocol(task: Any, stream: TaskStream | None = None, trained: int = 0, class_scope: str = "task"
                        ) -> dict[str, Any]:
    """What the model card says of how a task is evaluated: its kind, eval rows, prompt templates and the classes its
    headline is scored among: the task's own, or under `class_scope` seen/all every class seen after `trained` tasks
    / in the stream (`hf_ccl.class_prompts.scope_class_names`), which sets the chance level."""
    classes = len(task.class_names) if task.class_names else None
    if classes and class_scope != "task" and stream is not None:
        classes = len(scope_class_names(list(stream), trained, task, class_scope) or task.class_names)
    return {"task": task.name, "kind": task.kind, "split": "eval", "examples": len(task.eval), "classes": classes,
            "class_scope": class_scope,
            "templates": len(task.eval_templates or DEFAULT_TEMPLATES) if task.kind_spec.has_classes else None}



def newest_complete_trainer_checkpoint(trainer_dir: Path) -> str | None:
    """The newest `checkpoint-<n>/` under `trainer_dir` whose manifest verifies; newer ones that do not (cut short
    by a kill or a full disk, damaged) are removed with a warning. None when there is none."""
    if not trainer_dir.is_dir():
        return None
    candidates = [p for p in trainer_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
                  and p.name[len("checkpoint-"):].isdigit()]
    for folder in sorted(candidates, key=lambda p: int(p.name[len("checkpoint-"):]), reverse=True):
        if checkpoint_is_complete(folder):
            return str(folder)
        logger.warning("Trainer checkpoint %s is incomplete or damaged: removed; resuming from an earlier one", folder)
        shutil.rmtree(folder, ignore_errors=True)
    return None



def load_model_weights(model: PreTrainedModel, folder: Path) -> None:
    """Load a checkpoint's weights into `model` (strict), growing the token embedding (and the text position embedding)
    first if the vocabulary (or the context) grew. The weights are the files the checkpoint wrote
    (`checkpoint_weight_files`): one `model.safetensors`, or the shards its index names; every problem is an error
    naming the file."""
    files = checkpoint_weight_files(folder)
    shapes = _saved_shapes(files)
    token_key = f"{getattr(model, 'token_embedding_path', 'text_model.embeddings.token_embedding')}.weight"
    token_rows = cast(torch.nn.Embedding, model.get_input_embeddings()).weight.shape[0]
    if token_key in shapes and shapes[token_key][0] != token_rows:
        model.resize_token_embeddings(shapes[token_key][0])
    position_path = position_table_path(model)
    table = cast(torch.nn.Embedding, model.get_submodule(position_path))
    saved_rows = shapes.get(f"{position_path}.weight", (0,))[0]
    if saved_rows > table.num_embeddings:  # a context grown by `grow_vocab` (a table may hold offset rows)
        offset = table.num_embeddings - getattr(model, "max_text_positions", table.num_embeddings)
        resize_position_embeddings(model, saved_rows - offset)
    expected = {key for key in model.state_dict() if not key.endswith(("position_ids", "token_type_ids"))}
    loaded: set[str] = set()
    for path in files:
        state = _load_safetensors(path)
        loaded.update(state)
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as error:  # shapes that differ (another architecture or size)
            mismatched = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
            raise ValueError(f"{path} does not match the model: {'; '.join(mismatched[:3]) or error}") from None
        del state
    missing, unexpected = sorted(expected - loaded), sorted(loaded - set(model.state_dict()))
    if missing or unexpected:
        where = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
        raise ValueError(f"{where} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def checkpoint_weight_files(folder: Path) -> list[Path]:
    """The weight files `save_pretrained` wrote in `folder`: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json` (a save writes one or the other). With a manifest, it decides which (a file it
    does not list was added later); without one, both present is an error naming them. A shard the index names that
    is missing is an error naming it."""
    single, index = folder / SAFE_WEIGHTS_NAME, folder / SAFE_WEIGHTS_INDEX_NAME
    manifest = read_manifest(folder)
    if manifest is not None:
        listed = manifest["files"]
        single_ok, index_ok = single.name in listed and single.is_file(), index.name in listed and index.is_file()
    else:
        single_ok, index_ok = single.is_file(), index.is_file()
    if single_ok and index_ok:
        raise ValueError(f"Checkpoint {folder} holds both {single.name} and {index.name} (a save writes one or the "
                         "other): remove the one that was copied in")
    if single_ok:
        return [single]
    if not index_ok:
        raise ValueError(f"Checkpoint {folder} has no {single.name} (nor a sharded {index.name}): incomplete download "
                         "or copy?")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} lists no weights (its 'weight_map' is missing or empty)")
    shards = [folder / name for name in sorted(set(weight_map.values()))]
    absent = [shard.name for shard in shards if not shard.is_file()]
    if absent:
        raise ValueError(f"{index} names shard(s) {absent[:3]} that are not in {folder} (incomplete download or copy?)")
    return shards


def _saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in safetensors `files`, read from their headers (no tensor is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
            raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error
    return shapes


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error



def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {path} (truncated or corrupt?): {error}") from error

