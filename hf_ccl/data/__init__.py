"""Task streams from Hugging Face datasets, named benchmark streams, and the CLIP collator."""

from .builders import (
    CANONICAL_FEATURES,
    TaskSource,
    TextSpec,
    check_columns,
    load_split,
    resolve_class_names,
    stream_by_class,
    stream_by_column,
    stream_by_time,
    stream_class_incremental,
    stream_from_datasets,
    stream_random_split,
    to_canonical,
    validate_images,
)
from .collate import CLIPCollator, load_image_processor, load_tokenizer, stable_hash
from .dropped import log_dropped
from .images import CorruptImageError, MissingImageError, decode_image
from .kinds import ModelPart, get_task_kind, register_task_kind
from .mtil import MTIL_ORDERS, MTIL_REPOS, load_wds_classification, mtil_stream
from .named import DIGIT_CLASS_NAMES, NAMED_STREAMS, build_stream, describe_streams, digits_dataset
from .sources import DATA_FILE_READERS
from .streaming import column_names, is_empty, is_streaming, peek, to_streaming
from .task import CANONICAL_COLUMNS, NO_TASK, Task, TaskKind, TaskStream
from .templates import benchmark_templates, format_template
from .xtail import xtail_stream

__all__ = [
    "CANONICAL_COLUMNS",
    "CANONICAL_FEATURES",
    "CLIPCollator",
    "CorruptImageError",
    "DATA_FILE_READERS",
    "DIGIT_CLASS_NAMES",
    "MTIL_ORDERS",
    "MTIL_REPOS",
    "MissingImageError",
    "ModelPart",
    "NAMED_STREAMS",
    "NO_TASK",
    "Task",
    "TaskKind",
    "TaskSource",
    "TaskStream",
    "TextSpec",
    "benchmark_templates",
    "build_stream",
    "check_columns",
    "column_names",
    "decode_image",
    "describe_streams",
    "digits_dataset",
    "format_template",
    "get_task_kind",
    "is_empty",
    "is_streaming",
    "load_image_processor",
    "load_split",
    "load_tokenizer",
    "load_wds_classification",
    "log_dropped",
    "register_task_kind",
    "mtil_stream",
    "xtail_stream",
    "peek",
    "resolve_class_names",
    "stable_hash",
    "stream_by_class",
    "stream_by_column",
    "stream_by_time",
    "stream_class_incremental",
    "stream_from_datasets",
    "stream_random_split",
    "to_canonical",
    "to_streaming",
    "validate_images",
]
