"""hf_ccl: continual learning for CLIP-style vision-language models, native to Hugging Face.

The public API is importable from here (`from hf_ccl import ContinualLearner, build_stream, ...`). The names are
resolved on first use (PEP 562), so `import hf_ccl` and `hf-ccl --version` do not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

#: Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    # the loop
    "ContinualArguments": "hf_ccl.arguments",
    "CardArguments": "hf_ccl.arguments",
    "DiagnosticsArguments": "hf_ccl.arguments",
    "EvaluationArguments": "hf_ccl.arguments",
    "HubArguments": "hf_ccl.arguments",
    "PairArguments": "hf_ccl.arguments",
    "ContinualLearner": "hf_ccl.continual",
    "ContinualTrainer": "hf_ccl.trainer",
    "ResultsMatrix": "hf_ccl.evaluation.matrix",
    # models
    "ContinualCLIPModel": "hf_ccl.modeling",
    "ContinualDualEncoder": "hf_ccl.modeling",
    "tiny_clip_config": "hf_ccl.modeling",
    "family_class": "hf_ccl.families",
    # data
    "Task": "hf_ccl.data",
    "TaskKind": "hf_ccl.data",
    "TaskStream": "hf_ccl.data",
    "build_stream": "hf_ccl.data",
    "register_task_kind": "hf_ccl.data",
    "load_image_processor": "hf_ccl.data",
    "load_tokenizer": "hf_ccl.data",
    "stream_by_class": "hf_ccl.data",
    "stream_by_column": "hf_ccl.data",
    "stream_by_time": "hf_ccl.data",
    "stream_from_datasets": "hf_ccl.data",
    "stream_random_split": "hf_ccl.data",
    # methods
    "ContinualMethod": "hf_ccl.methods",
    "MethodConfig": "hf_ccl.methods",
    "TaskContext": "hf_ccl.methods",
    "available_methods": "hf_ccl.methods",
    "build_methods": "hf_ccl.methods",
    "register_method": "hf_ccl.methods",
    # callbacks
    "TaskCallback": "hf_ccl.callbacks",
    # configs (what `hf-ccl train` reads)
    "RunConfig": "hf_ccl.config",
    "load_config": "hf_ccl.config",
}

__all__ = [
    "__version__",
    "CardArguments",
    "ContinualArguments",
    "ContinualCLIPModel",
    "ContinualDualEncoder",
    "ContinualLearner",
    "ContinualMethod",
    "ContinualTrainer",
    "DiagnosticsArguments",
    "EvaluationArguments",
    "HubArguments",
    "MethodConfig",
    "PairArguments",
    "ResultsMatrix",
    "RunConfig",
    "Task",
    "TaskCallback",
    "TaskContext",
    "TaskKind",
    "TaskStream",
    "available_methods",
    "build_methods",
    "build_stream",
    "family_class",
    "load_config",
    "load_image_processor",
    "load_tokenizer",
    "register_method",
    "register_task_kind",
    "stream_by_class",
    "stream_by_column",
    "stream_by_time",
    "stream_from_datasets",
    "stream_random_split",
    "tiny_clip_config",
]

if TYPE_CHECKING:
    from .arguments import (
        CardArguments,
        ContinualArguments,
        DiagnosticsArguments,
        EvaluationArguments,
        HubArguments,
        PairArguments,
    )
    from .callbacks import TaskCallback
    from .config import RunConfig, load_config
    from .continual import ContinualLearner
    from .data import (
        Task,
        TaskKind,
        TaskStream,
        build_stream,
        load_image_processor,
        load_tokenizer,
        register_task_kind,
        stream_by_class,
        stream_by_column,
        stream_by_time,
        stream_from_datasets,
        stream_random_split,
    )
    from .evaluation.matrix import ResultsMatrix
    from .families import family_class
    from .methods import (
        ContinualMethod,
        MethodConfig,
        TaskContext,
        available_methods,
        build_methods,
        register_method,
    )
    from .modeling import ContinualCLIPModel, ContinualDualEncoder, tiny_clip_config
    from .trainer import ContinualTrainer


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is used."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_ccl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
