"""What a resumed run must share with the run it continues, and the readable diff when it does not.

Every task checkpoint stores the run's `settings` (`run_settings`): seed, the training section, methods and their
options, the compute rules, the evaluation subsample (`evaluation.max_examples`), and the stream (task names, sources, a
signature of each task's rows and one of its labels, classes and templates, so that a changed `max_train_per_task`,
`label_space` or data file is caught). A resume compares them key by key (`settings_diff`) and refuses
any difference not named in `resume_allow_changes` (dotted keys, `fnmatch` patterns allowed); allowed ones are
recorded as `resume_changes` in the next checkpoints (and shown in the model card).

Not compared, because they cannot change what is learned or measured after the resume point: progress bars, the
evaluation batch size, `evaluation.initial` (the initial row is already recorded), Hub settings, logging and reporting
options, dataloader workers, where and how often Trainer checkpoints are saved.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .data.streaming import is_streaming
from .data.task import TaskStream

#: Keys of the training section that are not compared on resume (they do not change what is trained).
UNCOMPARED_TRAINING = frozenset({
    "report_to", "logging_steps", "logging_strategy", "logging_first_step", "logging_dir", "run_name",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "save_strategy", "save_steps", "save_total_limit", "save_on_each_node", "save_safetensors",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_revision", "hub_always_push", "hub_private_repo",
    "torch_empty_cache_steps", "use_cpu",
})


def data_signature(dataset: Any) -> dict[str, Any]:
    """Rows and a hash of the `image_id` column (in order) of a split; a streaming split has no signature."""
    if is_streaming(dataset):
        return {"streaming": True}
    ids = dataset["image_id"] if "image_id" in dataset.column_names else list(range(len(dataset)))
    digest = hashlib.sha256(json.dumps([str(value) for value in ids]).encode()).hexdigest()[:16]
    return {"rows": len(dataset), "image_ids": digest}


def label_signature(task: Any) -> dict[str, Any]:
    """What a task's texts are made of besides its rows: its kind, class names, prompt templates and the labels of
    its rows (another `label_space`, class order or template set changes what is trained and scored)."""
    parts: dict[str, Any] = {"kind": task.kind, "classes": task.class_names, "train_templates": task.train_templates,
                             "eval_templates": task.eval_templates}
    for split in ("train", "eval"):
        dataset = getattr(task, split)
        if not is_streaming(dataset) and "label" in dataset.column_names:
            parts[f"{split}_labels"] = [int(value) for value in dataset["label"]]
    return {"digest": hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16],
            "classes": len(task.class_names) if task.class_names else None}


def run_settings(args: Any, stream: TaskStream, methods: Iterable[Any]) -> dict[str, Any]:
    """What a resume must match: from `ContinualArguments`, the stream and the methods."""
    methods = list(methods)
    return {
        "seed": args.seed,
        "training": {key: value for key, value in args.training.items() if key not in UNCOMPARED_TRAINING},
        "methods": [method.name for method in methods],
        "method_args": {method.name: method.config.to_dict() for method in methods},
        "first_task_epochs": args.first_task_epochs,
        "samples_per_task": args.samples_per_task,
        "warmup": args.warmup,
        "max_length": args.max_length,
        "diagnostics": {"spatial_disorder_task": args.diagnostics.spatial_disorder_task},
        # the rows each task is scored on: the rows before and after a resume must be comparable (stored only when
        # set, so that checkpoints written before the option resume unchanged)
        **({"evaluation": {"max_examples": args.evaluation.max_examples}}
           if args.evaluation.max_examples is not None else {}),
        # stored only when not the default, so that checkpoints written before these options resume unchanged
        **({"classification_loss": args.classification_loss} if args.classification_loss != "contrastive" else {}),
        **({"class_scope": args.class_scope} if args.class_scope != "task" else {}),
        "stream": {
            "name": stream.name,
            "tasks": [
                {"name": task.name, "source": task.source, "train": data_signature(task.train),
                 "eval": data_signature(task.eval), "labels": label_signature(task)}
                for task in stream
            ],
        },
    }


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}, "l": [{"c": 2}]}` -> `{"a.b": 1, "l.0.c": 2}` (JSON values, as saved)."""
    value = json.loads(json.dumps(value, default=str))
    flat: dict[str, Any] = {}

    def walk(item: Any, key: str) -> None:
        if isinstance(item, Mapping) and item:
            for name, child in item.items():
                walk(child, f"{key}.{name}" if key else str(name))
        elif isinstance(item, list) and item and any(isinstance(child, (Mapping, list)) for child in item):
            for position, child in enumerate(item):
                walk(child, f"{key}.{position}")
        else:
            flat[key] = item

    walk(value, prefix)
    return flat


_MISSING = "<not set>"
#: Settings keys that checkpoints of earlier hf_ccl versions stored under the options' old, top-level names.
_RENAMED = {"spatial_disorder_task": "diagnostics.spatial_disorder_task", "eval_max_examples": "evaluation.max_examples"}
#: Settings that checkpoints of earlier hf_ccl versions did not store: not compared when the saved run lacks them.
_ADDED_LATER = re.compile(r"stream\.tasks\.\d+\.labels(\..*)?$")


def settings_diff(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """`(dotted key, saved value, value now)` for every key whose value differs (keys saved only by a newer or older
    hf_ccl on one side are compared as well: absent shows as `<not set>`)."""
    old, new = {_RENAMED.get(key, key): value for key, value in flatten(saved).items()}, flatten(now)
    new = {key: value for key, value in new.items() if key in old or not _ADDED_LATER.match(key)}
    keys = sorted(set(old) | set(new))
    return [(key, old.get(key, _MISSING), new.get(key, _MISSING)) for key in keys
            if old.get(key, _MISSING) != new.get(key, _MISSING)]


def allowed(key: str, patterns: Iterable[str]) -> bool:
    """Whether `key` (or a parent of it: `method_args.er` allows `method_args.er.buffer_size`) matches a pattern."""
    parts = key.split(".")
    prefixes = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)


_DATA_KEY = re.compile(r"stream\.tasks\.(\d+)\.(train|eval|labels)\.(rows|image_ids|streaming|digest|classes)$")


def describe_diff(changes: list[tuple[str, Any, Any]]) -> tuple[str, list[str]]:
    """One `key: saved -> now` entry per changed setting, the changed data of the stream's tasks summed up in one
    entry; and the keys to give `resume_allow_changes` to accept them all."""
    entries, keys, data_tasks, rows = [], [], [], []
    for key, saved, now in changes:
        match = _DATA_KEY.match(key)
        if match is None:
            entries.append(f"{key}: {saved!r} -> {now!r}")
            keys.append(key)
            continue
        data_tasks.append(int(match.group(1)))
        if match.group(3) == "rows":
            rows.append(f"task {match.group(1)} {match.group(2)} rows {saved} -> {now}")
        elif match.group(3) == "classes":
            rows.append(f"task {match.group(1)} classes {saved} -> {now}")
    if data_tasks:
        tasks = sorted(set(data_tasks))
        detail = f" ({', '.join(rows[:3])}{', ...' if len(rows) > 3 else ''})" if rows else ""
        entries.append(f"stream.tasks: the data of task(s) {tasks} differs{detail}; the stream's options "
                       "(max_train_per_task, max_eval_per_task, label_space, templates, the seed that draws them) or "
                       "its data files changed")
        keys.append("stream.tasks")
    return "; ".join(entries), keys
