"""Build a continual run from a `RunConfig` and execute it: what `recipes/train.py` and `hf-ccl train` call."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import CLIPImageProcessorPil, PreTrainedTokenizerBase

from .compute import compute_summary
from .config import RunConfig, save_config
from .continual import ContinualArguments, ContinualLearner
from .data.collate import load_image_processor, load_tokenizer
from .data.named import NAMED_STREAMS, build_stream, check_stream_options
from .data.spec import RUN_SUPPLIED, STREAM_BUILDERS, build_stream_from_spec, check_stream_spec
from .data.task import TaskStream
from .distributed import is_main_process
from .evaluation.matrix import ResultsMatrix
from .methods import build_methods
from .modeling import ContinualCLIPModel, tiny_clip_config

logger = logging.getLogger(__name__)


def load_model(config: RunConfig) -> ContinualCLIPModel:
    """The checkpoint in `model.pretrained`, else a random CLIP from `model.config` (seeded)."""
    pretrained = config.model.get("pretrained")
    if pretrained:
        return ContinualCLIPModel.from_pretrained(pretrained)
    torch.manual_seed(config.seed)
    return ContinualCLIPModel(tiny_clip_config(**(config.model.get("config") or {})))


def _has_file(path: str | None, name: str) -> bool:
    return bool(path) and (Path(path) / name).is_file()


def load_processors(config: RunConfig, model: ContinualCLIPModel) -> tuple[Any, PreTrainedTokenizerBase]:
    """Image processor (PIL backend) and tokenizer: the config's, else the checkpoint's, else the defaults."""
    pretrained = config.model.get("pretrained")
    tokenizer_source = config.tokenizer or (pretrained if _has_file(pretrained, "tokenizer_config.json") else None)
    tokenizer = load_tokenizer(tokenizer_source)
    if _has_file(pretrained, "preprocessor_config.json"):
        image_processor = CLIPImageProcessorPil.from_pretrained(pretrained)
    else:
        image_processor = load_image_processor(model.config.vision_config.image_size)
    return image_processor, tokenizer


def build_run_stream(config: RunConfig) -> TaskStream:
    """The config's stream: a named stream, or a spec mapping built by `hf_ccl.data.spec`."""
    if isinstance(config.stream, dict):
        return build_stream_from_spec(config.stream, data_root=config.data_root, seed=config.seed, **config.stream_args)
    return build_stream(config.stream, data_root=config.data_root, seed=config.seed, **config.stream_args)


def check_config(config: RunConfig) -> None:
    """Fail on unknown streams, methods and options before any data is read or model built."""
    if isinstance(config.stream, dict):
        check_stream_spec(config.stream)
        unknown = sorted(set(config.stream_args) - set(RUN_SUPPLIED))
        if unknown:
            raise ValueError(f"Unknown stream_args {unknown} for a stream spec; valid: {', '.join(RUN_SUPPLIED[1:])}")
    elif config.stream not in NAMED_STREAMS:
        raise ValueError(
            f"Unknown stream {config.stream!r}; valid streams: {', '.join(sorted(NAMED_STREAMS))}, "
            f"or a mapping with `builder` ({', '.join(STREAM_BUILDERS)})"
        )
    else:
        check_stream_options(config.stream, config.stream_args)
    build_methods(config.methods, config.method_args)


def run(config: RunConfig) -> ResultsMatrix:
    """Build stream, model, processors and methods from `config`, run the stream, return the results matrix."""
    check_config(config)
    methods = build_methods(config.methods, config.method_args)
    args = ContinualArguments(
        output_dir=config.output_dir,
        training=dict(config.training),
        first_task_epochs=config.first_task_epochs,
        eval_batch_size=config.eval_batch_size,
        max_length=config.max_length,
        seed=config.seed,
        progress=config.progress,
        spatial_disorder_task=config.spatial_disorder_task,
        samples_per_task=config.samples_per_task,
        warmup=config.warmup,
        evaluate_initial=config.evaluate_initial,
        resume_from_checkpoint=config.resume_from_checkpoint,
        hub_model_id=config.hub_model_id,
        hub_private_repo=config.hub_private_repo,
        hub_timeout=config.hub_timeout,
        hub_retries=config.hub_retries,
    )
    stream = build_run_stream(config)
    model = load_model(config)
    image_processor, tokenizer = load_processors(config, model)
    if is_main_process():
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(config, Path(config.output_dir) / "run_config.yaml")
    learner = ContinualLearner(model, stream, methods, image_processor, tokenizer, args)
    results = learner.fit()
    if learner.compute and is_main_process():
        print(compute_summary(learner.compute), flush=True)
    if learner.push_report is not None and is_main_process():
        print(learner.push_report.summary(), flush=True)
    return results
