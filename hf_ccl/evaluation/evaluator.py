"""Score a model on a task's eval split: Recall@K for captioned tasks, zero-shot accuracy for class-label tasks.

Evaluation embeds each eval set once and runs in a single process; in a distributed run call it on the main
process only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from datasets import Dataset

from ..data.task import Task
from .encode import encode_images, encode_texts
from .pairs import evaluate_pair_task
from .retrieval import captions_to_text_to_image, recall_at_k, unique_texts
from .zeroshot import DEFAULT_TEMPLATES, zero_shot_accuracy, zero_shot_classifier


def iter_column(dataset: Dataset, column: str, batch_size: int = 256) -> Iterator[Any]:
    """Yield one column's values, reading `batch_size` rows at a time (never the whole column at once)."""
    for batch in dataset.select_columns([column]).iter(batch_size=batch_size):
        yield from batch[column]


def _encode_eval_images(
    model: torch.nn.Module, task: Task, image_processor: Any, batch_size: int
) -> torch.Tensor:
    values = iter_column(task.eval, "image", batch_size)
    return encode_images(
        model, image_processor, values, batch_size=batch_size, where_prefix=f"{task.name}/eval"
    )


def _evaluate_retrieval(
    model: torch.nn.Module,
    task: Task,
    image_processor: Any,
    tokenizer: Any,
    batch_size: int,
    max_length: int | None,
    chunk_size: int,
) -> dict[str, float]:
    texts, text_to_image = captions_to_text_to_image(list(iter_column(task.eval, "texts", batch_size)))
    distinct, text_ids = unique_texts(texts)  # a caption on several images is one text, a positive of each
    image_embeds = _encode_eval_images(model, task, image_processor, batch_size)
    text_embeds = encode_texts(model, tokenizer, distinct, batch_size=batch_size, max_length=max_length)
    return recall_at_k(image_embeds, text_embeds[text_ids.to(text_embeds.device)], text_to_image,
                       chunk_size=chunk_size, text_ids=text_ids)


def _evaluate_classification(
    model: torch.nn.Module,
    task: Task,
    image_processor: Any,
    tokenizer: Any,
    batch_size: int,
    max_length: int | None,
) -> dict[str, float]:
    templates = list(task.eval_templates or DEFAULT_TEMPLATES)
    class_embeds = zero_shot_classifier(
        model,
        list(task.class_names or []),
        templates,
        tokenizer,
        batch_size=batch_size,
        max_length=max_length,
    )
    labels = torch.tensor(list(iter_column(task.eval, "label", batch_size)), dtype=torch.long)
    image_embeds = _encode_eval_images(model, task, image_processor, batch_size)
    return zero_shot_accuracy(image_embeds, labels, class_embeds)


def evaluate_task(
    model: torch.nn.Module,
    task: Task,
    image_processor: Any,
    tokenizer: Any,
    *,
    batch_size: int = 256,
    max_length: int | None = None,
    chunk_size: int = 1024,
) -> dict[str, float]:
    """All metrics of `model` on `task.eval`, always including `task.headline_metric`.

    Retrieval tasks: `recall_at_k` over every eval image and all of its captions (`i2t_R@K`, `t2i_R@K`, `R_mean`);
    identical captions are one text, a positive of every image they describe, and ties count in expectation.
    Classification tasks: zero-shot accuracy among `task.class_names` with the `task.eval_templates` ensemble
    (default `["a photo of a {label}."]`): `accuracy`, `top5_accuracy` when there are more than 5 classes.
    Pair tasks (encoded by `hf_ccl.pair_features`): Recall@K between their two modalities' learner outputs, and
    the drift of their alignment matrix once learned (`hf_ccl.evaluation.pairs`).
    The model's training mode is restored afterwards.
    """
    if task.kind == "pair":
        metrics = evaluate_pair_task(model, task)
    elif task.kind == "retrieval":
        metrics = _evaluate_retrieval(
            model, task, image_processor, tokenizer, batch_size, max_length, chunk_size
        )
    else:
        metrics = _evaluate_classification(model, task, image_processor, tokenizer, batch_size, max_length)
    if task.headline_metric not in metrics:
        raise RuntimeError(
            f"task {task.name!r}: headline metric {task.headline_metric!r} missing from {metrics}"
        )
    return metrics


def evaluate_stream(
    model: torch.nn.Module,
    tasks: Iterable[Task],
    image_processor: Any,
    tokenizer: Any,
    *,
    batch_size: int = 256,
    max_length: int | None = None,
    chunk_size: int = 1024,
) -> dict[str, dict[str, float]]:
    """`evaluate_task` on every task (a `TaskStream` or a list of `Task`), keyed by task name in stream order."""
    results: dict[str, dict[str, float]] = {}
    for task in tasks:
        if task.name in results:
            raise ValueError(f"two tasks are named {task.name!r}; task names must be unique")
        results[task.name] = evaluate_task(
            model,
            task,
            image_processor,
            tokenizer,
            batch_size=batch_size,
            max_length=max_length,
            chunk_size=chunk_size,
        )
    return results
