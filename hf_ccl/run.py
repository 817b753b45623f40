"""Build a continual run from a `RunConfig` and execute it: what `recipes/train.py` and `hf-ccl train` call."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoImageProcessor, PreTrainedTokenizerBase
from transformers.utils import cached_file

from .arguments import ContinualArguments
from .checkpointing import CHECKPOINT_STATE, check_same_architecture, latest_task_checkpoint
from .checks import RunPlan, check_plan
from .compute import ComputeCallback, compute_summary
from .config import RunConfig, save_config
from .continual import ContinualLearner
from .data.builders import check_builder_options
from .data.collate import load_tokenizer
from .data.named import NAMED_STREAMS, build_stream, check_stream_options
from .data.spec import RUN_SUPPLIED, STREAM_BUILDERS, build_stream_from_spec, check_stream_spec
from .data.stream_registry import STREAM_CHECKS
from .data.task import TaskStream
from .distributed import is_main_process
from .evaluation.matrix import ResultsMatrix
from .families import (
    default_image_processor,
    family_class,
    family_of,
    load_continual_model,
    tiny_config,
)
from .hub import PushFailedError
from .methods import ContinualMethod, build_methods
from .methods.sizes import check_method_sizes, check_model_memory, model_skeleton
from .modeling import ContinualDualEncoder
from .paths import check_default_tokenizer
from .run_folder import RunFolderError, RunFolderLock, check_run_folder
from .validation import ConfigError, check_mapping, type_hints

logger = logging.getLogger(__name__)


def load_model(config: RunConfig) -> ContinualDualEncoder:
    """The checkpoint in `model.pretrained` in its family's class (`model.family`, if given, must match it), else a
    random model of `model.family` (default CLIP) from `model.config` (seeded)."""
    pretrained, family = config.model.get("pretrained"), config.model.get("family")
    if pretrained:
        return load_continual_model(pretrained, family)
    torch.manual_seed(config.seed)
    family = family or "clip"
    return family_class(family)(tiny_config(family, **(config.model.get("config") or {})))


def config_family(config: RunConfig) -> str | None:
    """The family the run's model will have, when it is known without downloading: a local checkpoint's
    `model_type` (which `model.family`, if given, must match), `model.family`, or CLIP for a random model; None for
    a Hub id without `model.family`."""
    pretrained, family = config.model.get("pretrained"), config.model.get("family")
    path = Path(pretrained) / "config.json" if pretrained else None
    if path is None or not path.is_file():
        return family or ("clip" if not pretrained else None)
    found = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    try:
        found = family_of(str(found))
        if family is not None and family_of(family) != found:
            raise ValueError(f"model.family is {family!r} but {pretrained} is a {found!r} checkpoint")
    except ValueError as error:
        raise ConfigError(f"model.pretrained: {error}", "model.pretrained") from None
    return found


def checkpoint_file(source: str, name: str) -> str | None:
    """The path of file `name` of a checkpoint (a folder, or a Hub id: downloaded), or None when it has none."""
    return cached_file(source, name, _raise_exceptions_for_missing_entries=False)


def load_processors(config: RunConfig, model: ContinualDualEncoder) -> tuple[Any, PreTrainedTokenizerBase]:
    """Image processor (PIL backend) and tokenizer: the config's `tokenizer`, else the checkpoint's own (a folder or a
    Hub id, each loaded as plain transformers loads it), else the family's defaults at the model's sizes, with a
    logged notice. A checkpoint without a tokenizer is refused unless its vocabulary has the size of the bundled CLIP
    tokenizer's: its token embedding means nothing under another tokenizer (`pretrained_tokenizer_error`)."""
    pretrained = config.model.get("pretrained")
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    elif pretrained and checkpoint_file(pretrained, "tokenizer_config.json"):
        tokenizer = load_tokenizer(pretrained)
    else:
        tokenizer = load_tokenizer()
        if pretrained:
            embeddings = model.get_input_embeddings()
            assert isinstance(embeddings, torch.nn.Embedding)  # a dual encoder's token embedding
            vocabulary = embeddings.num_embeddings
            error = pretrained_tokenizer_error(pretrained, vocabulary, len(tokenizer))
            if error:
                raise ValueError(error)
            logger.warning("model.pretrained %s has no tokenizer: using the bundled CLIP tokenizer, whose %d tokens "
                           "match its vocabulary (set `tokenizer` if it was trained with another)", pretrained,
                           len(tokenizer))
    if pretrained and checkpoint_file(pretrained, "preprocessor_config.json"):
        image_processor = AutoImageProcessor.from_pretrained(pretrained, backend="pil")
    else:
        image_processor = default_image_processor(model)
        if pretrained:
            logger.warning("model.pretrained %s has no image processor (preprocessor_config.json): using the %s "
                           "family's default at %d pixels (%s)", pretrained, model.family, model.image_size,
                           type(image_processor).__name__)
    return image_processor, tokenizer


def pretrained_tokenizer_error(pretrained: str, vocab_size: int, default_size: int) -> str | None:
    """Why a checkpoint without a tokenizer cannot fall back to the bundled CLIP tokenizer (None when it can: the
    vocabularies have the same size)."""
    if vocab_size == default_size:
        return None
    return (f"model.pretrained {pretrained!r} has no tokenizer (tokenizer_config.json) and its vocabulary "
            f"({vocab_size} tokens) is not the bundled CLIP tokenizer's ({default_size}): set `tokenizer` to the "
            "tokenizer it was trained with")


def check_pretrained_tokenizer(config: RunConfig) -> None:
    """A local checkpoint without a tokenizer (and no `tokenizer` set) that the bundled one does not fit is refused
    before anything is built (a Hub checkpoint is checked when it is loaded)."""
    pretrained = config.model.get("pretrained")
    if not pretrained or config.tokenizer is not None or not Path(pretrained, "config.json").is_file() \
            or Path(pretrained, "tokenizer_config.json").is_file():
        return
    text_config = json.loads(Path(pretrained, "config.json").read_text(encoding="utf-8")).get("text_config") or {}
    error = pretrained_tokenizer_error(pretrained, int(text_config.get("vocab_size", -1)), len(load_tokenizer()))
    if error:
        raise ConfigError(error, "tokenizer")


def build_run_stream(config: RunConfig) -> TaskStream:
    """The config's stream: a named stream, or a spec mapping built by `hf_ccl.data.spec`."""
    if isinstance(config.stream, dict):
        return build_stream_from_spec(config.stream, data_root=config.data_root, seed=config.seed, **config.stream_args)
    return build_stream(config.stream, data_root=config.data_root, seed=config.seed, **config.stream_args)


@dataclass
class CheckedRun:
    """A config that passed every check made before a run (`check_config`), with what the checks built: the loop's
    arguments, the methods and what was checked of them (`plan`, which the learner takes instead of checking them
    again). `run` takes it as it is: nothing is checked or built twice."""

    config: RunConfig
    args: ContinualArguments
    methods: list[ContinualMethod]
    plan: RunPlan
    #: When the run's start-up began (`time.time()`; `hf-ccl train`: the process's start); None: when `run` is called.
    started_at: float | None = None


def check_config(config: RunConfig, check_paths: bool = True) -> CheckedRun:
    """Everything a run is asked to do, checked before any data is read, model built or file written: every value of
    the config (types, ranges, the training section and the sections; again only if a value changed since it was
    made), the stream and its options, the methods, their options and how they fit the arguments and the model's
    family (`hf_ccl.checks.check_plan`), and (`check_paths`) the local paths. Returns the checked run, with its
    `ContinualArguments`, its methods built and its `RunPlan`."""
    args = config.checked_arguments()
    check_stream(config)
    methods = build_methods(config.methods, config.method_args)
    if check_paths:
        check_local_paths(config)
        check_pretrained_tokenizer(config)
    plan = check_plan(args, methods, config_family(config))
    where = "model.pretrained" if config.model.get("pretrained") else "model.config"
    try:  # the run's model on the meta device: its sizes, nothing allocated
        skeleton = model_skeleton(config.model)
    except (RuntimeError, OverflowError) as error:  # sizes whose tensors overflow even on the meta device
        raise ConfigError(f"{where} describes a model that cannot be built: {error}", where) from error
    if skeleton is not None:
        check_model_memory(skeleton, where)
        check_method_sizes(methods, skeleton)
        if check_paths and is_main_process():
            check_resumed_model(config, skeleton)
    return CheckedRun(config, args, methods, plan)


def check_resumed_model(config: RunConfig, skeleton: torch.nn.Module) -> None:
    """A resume from a local task checkpoint whose model is of another family or size than the one the config
    builds: refused now (naming the difference), not when the weights fail to load."""
    if config.resume_from_checkpoint in (None, False):
        return
    request = config.resume_from_checkpoint
    given = Path(request) if isinstance(request, str) and request != "auto" else Path(config.output_dir)
    folder = given if (given / CHECKPOINT_STATE).is_file() else latest_task_checkpoint(given, warn=False)
    if folder is not None and (folder / "config.json").is_file():
        check_same_architecture(skeleton.config, folder)  # type: ignore[arg-type]  # a PreTrainedModel's config


def check_stream(config: RunConfig) -> None:
    """An unknown stream, builder or option, or an option of the wrong type, is an error naming it."""
    if isinstance(config.stream, dict):
        check_stream_spec(config.stream)
        builder = STREAM_BUILDERS[config.stream["builder"]]
        hints = type_hints(builder)
        arguments = {key: value for key, value in config.stream.items() if key != "builder"}
        config.stream = {"builder": config.stream["builder"], **check_mapping(arguments, hints, "stream.")}
        unknown = sorted(set(config.stream_args) - set(RUN_SUPPLIED))
        if unknown:
            raise ConfigError(f"Unknown stream_args {unknown} for a stream spec; valid: {', '.join(RUN_SUPPLIED[1:])}")
        config.stream_args = check_mapping(config.stream_args, hints, "stream_args.")
        check_shared_options({**arguments, **config.stream_args})
        return
    if config.stream not in NAMED_STREAMS:
        raise ConfigError(
            f"Unknown stream {config.stream!r}; valid streams: {', '.join(sorted(NAMED_STREAMS))}, "
            f"or a mapping with `builder` ({', '.join(STREAM_BUILDERS)})"
        )
    check_stream_options(config.stream, config.stream_args)
    for key, instead in (("data_root", "data_root"), ("seed", "seed")):
        if key in config.stream_args:
            raise ConfigError(f"stream_args.{key}: set the top-level {instead} instead (the run passes it)",
                              f"stream_args.{key}")
    hints = {**type_hints(build_stream), **type_hints(NAMED_STREAMS[config.stream])}
    config.stream_args = check_mapping(config.stream_args, hints, "stream_args.")
    check_shared_options(config.stream_args)
    if config.stream in STREAM_CHECKS:  # the stream's own values (a pinned revision, a setting), before any download
        try:
            STREAM_CHECKS[config.stream](**config.stream_args)
        except ValueError as error:
            raise ConfigError(f"stream_args: {error}") from error


def check_shared_options(values: dict[str, Any]) -> None:
    """Ranges of the options every stream builder takes (`max_train_per_task >= 1`, ...), before any data is read."""
    try:
        check_builder_options(values)
    except ValueError as error:
        raise ConfigError(f"stream: {error}") from error


def check_local_paths(config: RunConfig) -> None:
    """The model checkpoint, tokenizer and data root: a path that looks local must exist (else "no such folder",
    not a message about Hub repository ids); the output folder must not be a file."""
    pretrained = config.model.get("pretrained")
    if pretrained is not None:
        config.model["pretrained"] = check_source("model.pretrained", pretrained, "config.json")
    if config.tokenizer is not None:
        config.tokenizer = check_source("tokenizer", config.tokenizer, None)
    elif pretrained is None:  # the default tokenizer: the shared folder's, else the Hub's (a pip install)
        try:
            check_default_tokenizer()
        except OSError as error:
            raise ConfigError(str(error), "tokenizer") from error
    if config.data_root is not None and not Path(config.data_root).expanduser().is_dir():
        raise ConfigError(f"data_root: no such folder {config.data_root!r} (the folder of the HF dataset folders)",
                          "data_root")
    if Path(config.output_dir).expanduser().is_file():
        raise ConfigError(f"output_dir {config.output_dir!r} is a file, not a folder", "output_dir")
    existing = Path(config.output_dir).expanduser().absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if is_main_process() and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {config.output_dir!r} cannot be written: {existing} is read-only (a read-only "
                          "disk, or no permission)", "output_dir")
    if is_main_process():  # another run in the folder: refused now, not after the run is built
        try:
            check_run_folder(Path(config.output_dir), resume=config.resume_from_checkpoint not in (None, False),
                             overwrite=config.overwrite_output_dir)
        except RunFolderError as error:
            raise ConfigError(str(error), "output_dir") from None


def check_source(key: str, value: str, required_file: str | None) -> str:
    """A local folder (with `required_file`), or a Hub repository id; returns the value with `~` expanded."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {value!r} is a file; give the folder that holds it", key)
        if required_file is not None and not (path / required_file).is_file():
            raise ConfigError(f"{key}: the folder {value!r} has no {required_file} (not a saved checkpoint; a task "
                              "checkpoint is <output_dir>/task-<k>)", key)
        return str(path) if value.startswith("~") else value
    if looks_local(value):
        raise ConfigError(f"{key}: no such folder {value!r} (relative paths start from {Path.cwd()})", key)
    return value


def looks_local(value: str) -> bool:
    """Whether a name can only be a local path, never a Hub repository id (`org/name`)."""
    if value.startswith((".", "/", "~")) or "\\" in value or value.count("/") > 1:
        return True
    try:
        validate_repo_id(value)
    except HFValidationError:
        return True
    return False


def run(config: RunConfig | CheckedRun) -> ResultsMatrix:
    """Build stream, model and processors, run the stream with the checked methods and arguments, return the results
    matrix. A `RunConfig` is checked first (`check_config`); a `CheckedRun` is run as it was checked. The run's
    start-up cost (`hf_ccl.compute.RunPhases`) counts from the `CheckedRun`'s `started_at`, else from this call."""
    called_at = time.time()
    # everything is checked before the stream is built or anything is written
    checked = config if isinstance(config, CheckedRun) else check_config(config)
    config = checked.config
    lock = RunFolderLock(config.output_dir)
    created = not Path(config.output_dir).exists()
    if is_main_process():  # held from before the run is built until it has reported: no other run slips in
        lock.acquire()
    try:
        return _run_locked(checked, lock, called_at)
    finally:
        lock.release(remove_if_alone=created)  # a run that failed before writing anything leaves nothing


def _run_locked(checked: CheckedRun, lock: RunFolderLock, called_at: float) -> ResultsMatrix:
    config = checked.config
    stream = build_run_stream(config)
    model = load_model(config)
    image_processor, tokenizer = load_processors(config, model)
    learner = ContinualLearner(model, stream, checked.methods, image_processor, tokenizer, checked.args,
                               plan=checked.plan)
    learner.started_at = checked.started_at if checked.started_at is not None else called_at
    learner.claim_output_dir(lock)  # not another run's folder, before anything is written there
    if is_main_process():
        save_config(config, Path(config.output_dir) / "run_config.yaml")
    results = learner.fit()
    if learner.compute and is_main_process():
        accounting = learner.task_callbacks.get(ComputeCallback)
        assert isinstance(accounting, ComputeCallback)  # one of the learner's built-in callbacks
        print(compute_summary(learner.compute, accounting.run), flush=True)
    report = learner.push_report
    if report is not None and is_main_process():
        if report.failed:  # after training and every local checkpoint: the run did not do all it was asked
            raise PushFailedError(report, config.output_dir)
        print(report.summary(), flush=True)
    return results
