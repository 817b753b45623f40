"""Streams described as data (a YAML mapping), so a recipe can point at any HF dataset, not only a named stream.

    stream:
      builder: by_column            # by_column | random_split | by_class | by_time | datasets
      train: pacs                   # a folder or data file under the data root, any local dataset folder or
                                    # .parquet/.csv/.tsv/.json/.jsonl file, a save_to_disk folder, or a Hub dataset id
      column: domain
      values: [photo, sketch]
      label_column: label
      train_templates: ["a {label}."]

The other keys are the builder's arguments (`hf_ccl.data.builders`); unknown or missing ones are errors raised
before any data is read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..paths import data_root as default_data_root
from .builders import (
    stream_by_class,
    stream_by_column,
    stream_by_time,
    stream_from_datasets,
    stream_random_split,
)
from .task import TaskStream

STREAM_BUILDERS: dict[str, Callable[..., TaskStream]] = {
    "by_column": stream_by_column,
    "random_split": stream_random_split,
    "by_class": stream_by_class,
    "by_time": stream_by_time,
    "datasets": stream_from_datasets,
}
#: Arguments the run supplies itself (from `data_root`, `seed` and `stream_args`), not part of a spec.
RUN_SUPPLIED = ("seed", "max_train_per_task", "max_eval_per_task", "validate_images")
#: Arguments that name data sources, resolved against the data root; a missing `eval` means the train source
#: read at its `eval_split` ("test" by default).
SOURCE_KEYS = ("train", "eval")


def _parameters(builder: Callable[..., TaskStream]) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(builder).parameters.items() if name not in RUN_SUPPLIED}


def check_stream_spec(spec: Mapping[str, Any]) -> None:
    """Reject an unknown builder, unknown arguments or missing required ones, listing the valid choices."""
    builder_name = spec.get("builder")
    if builder_name not in STREAM_BUILDERS:
        raise ValueError(
            f"A stream spec needs `builder`, one of: {', '.join(STREAM_BUILDERS)} (got {builder_name!r}); "
            "or give the name of a named stream instead of a mapping"
        )
    parameters = _parameters(STREAM_BUILDERS[builder_name])
    arguments = {key for key in spec if key != "builder"}
    unknown = sorted(arguments - set(parameters))
    if unknown:
        raise ValueError(
            f"Unknown argument(s) {unknown} for stream builder {builder_name!r}; valid: {', '.join(parameters)}"
        )
    missing = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty and name not in arguments and name != "eval"
    ]
    if missing:
        raise ValueError(f"Stream builder {builder_name!r} needs argument(s) {missing}")


def resolve_source(value: Any, root: Path) -> Any:
    """A relative path that names a folder or file under the data root (and not under the working directory)
    becomes that path; anything else is left as is (an absolute or relative local path, a Hub dataset id, or a
    `datasets.Dataset`). See `hf_ccl.data.sources` for the kinds of source."""
    if isinstance(value, str) and not Path(value).exists() and (root / value).exists():
        return str(root / value)
    return value


def build_stream_from_spec(
    spec: Mapping[str, Any], *, data_root: str | Path | None = None, seed: int = 0, **run_options: Any
) -> TaskStream:
    """Build a stream from a spec mapping; `run_options` are `max_train_per_task`, `max_eval_per_task`,
    `validate_images`."""
    check_stream_spec(spec)
    root = Path(data_root) if data_root is not None else default_data_root()
    arguments = {key: value for key, value in spec.items() if key != "builder"}
    if "eval" in _parameters(STREAM_BUILDERS[spec["builder"]]):
        arguments.setdefault("eval", None)  # None: the train source read at `eval_split`
    for key in SOURCE_KEYS:
        if key in arguments:
            arguments[key] = resolve_source(arguments[key], root)
    if spec["builder"] == "datasets":
        arguments["entries"] = [
            {**entry, **{k: resolve_source(entry[k], root) for k in SOURCE_KEYS if k in entry}}
            if isinstance(entry, Mapping)
            else entry
            for entry in arguments["entries"]
        ]
    return STREAM_BUILDERS[spec["builder"]](**arguments, seed=seed, **run_options)
