"""Score a model on a task's eval split: Recall@K for captioned tasks, zero-shot accuracy for class-label tasks.

Evaluation embeds each eval set once and runs in a single process; in a distributed run call it on the main
process only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from datasets import Dataset

from ..data.task import EvalSetup, Task
from .cache import CacheSession, EmbeddingCache
from .checks import NonFiniteEmbeddingError
from .encode import encode_images, encode_texts
from .ensemble import ensemble_scores, evaluation_ensemble
from .retrieval import captions_to_text_to_image, recall_at_k, unique_texts
from .routing import EvaluationRouter, evaluation_router, route_groups, routing_metrics
from .scoring import evaluation_scorer
from .zeroshot import DEFAULT_TEMPLATES, accuracy_from_scores, zero_shot_accuracy, zero_shot_classifier


def iter_column(dataset: Dataset, column: str, batch_size: int = 256) -> Iterator[Any]:
    """Yield one column's values, reading `batch_size` rows at a time (never the whole column at once)."""
    for batch in dataset.select_columns([column]).iter(batch_size=batch_size):
        yield from batch[column]


def _encode_eval_images(
    model: torch.nn.Module, task: Task, image_processor: Any, batch_size: int, cache: CacheSession | None
) -> torch.Tensor:
    def compute() -> torch.Tensor:
        values = iter_column(task.eval, "image", batch_size)  # streamed: one batch of decoded images at a time
        return encode_images(model, image_processor, values, batch_size=batch_size, where_prefix=f"{task.name}/eval")

    return compute() if cache is None else cache.images(task.name, task.eval, compute)


def evaluate_retrieval(model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
    """Recall@K of a captioned task (`RetrievalKind.evaluate`; see `evaluate_task`)."""
    image_processor, tokenizer, batch_size, max_length = (setup.image_processor, setup.tokenizer, setup.batch_size,
                                                          setup.max_length)
    chunk_size, cache = setup.chunk_size, setup.cache
    texts, text_to_image = captions_to_text_to_image(list(iter_column(task.eval, "texts", batch_size)))
    distinct, text_ids = unique_texts(texts)  # a caption on several images is one text, a positive of each
    image_embeds = _encode_eval_images(model, task, image_processor, batch_size, cache)

    def compute() -> torch.Tensor:
        return encode_texts(model, tokenizer, distinct, batch_size=batch_size, max_length=max_length)

    text_embeds = compute() if cache is None else cache.texts(task.name, task.eval, distinct, compute)
    return recall_at_k(image_embeds, text_embeds[text_ids.to(text_embeds.device)], text_to_image,
                       chunk_size=chunk_size, text_ids=text_ids)


def evaluate_classification(model: torch.nn.Module, task: Task, setup: EvalSetup) -> dict[str, float]:
    """Zero-shot accuracy of a class-label task (`ClassificationKind.evaluate`; see `evaluate_task`)."""
    image_processor, tokenizer, batch_size, max_length = (setup.image_processor, setup.tokenizer, setup.batch_size,
                                                          setup.max_length)
    cache, seen_class_names = setup.cache, setup.seen_class_names
    templates = list(task.eval_templates or DEFAULT_TEMPLATES)
    class_names = list(task.class_names or [])

    def classifier(names: list[str], kind: str) -> torch.Tensor:
        def compute() -> torch.Tensor:
            return zero_shot_classifier(model, names, templates, tokenizer, batch_size=batch_size,
                                        max_length=max_length)

        return compute() if cache is None else cache.texts(task.name, task.eval, [names, templates], compute, kind)

    labels = torch.tensor(list(iter_column(task.eval, "label", batch_size)), dtype=torch.long)
    seen_labels = None
    if seen_class_names is not None:  # task-agnostic: among every class seen so far (the task's own included)
        seen = list(seen_class_names)
        missing = sorted(set(class_names) - set(seen))
        if missing:
            raise ValueError(f"task {task.name!r}: seen_class_names lacks the task's own classes {missing}")
        position = {name: index for index, name in enumerate(seen)}
        seen_labels = torch.tensor([position[class_names[label]] for label in labels.tolist()], dtype=torch.long)

    scorer = evaluation_scorer(model)

    def accuracy(image_embeds: torch.Tensor, rows_labels: torch.Tensor, names: list[str], kind: str
                 ) -> dict[str, float]:
        class_embeds = classifier(names, kind)
        scores = None if scorer is None else scorer.class_scores(image_embeds, class_embeds, names)
        if scores is None:
            return zero_shot_accuracy(image_embeds, rows_labels, class_embeds)
        if tuple(scores.shape) != (image_embeds.shape[0], len(names)):
            raise RuntimeError(f"{type(scorer).__name__}.class_scores returned shape {tuple(scores.shape)}, "
                               f"expected {(image_embeds.shape[0], len(names))}")
        return accuracy_from_scores(scores, rows_labels)

    def score(image_embeds: torch.Tensor, rows: torch.Tensor | slice) -> dict[str, float]:
        metrics = accuracy(image_embeds, labels[rows], class_names, "classes")
        if seen_labels is not None:
            seen_metrics = accuracy(image_embeds, seen_labels[rows], seen, f"{setup.class_scope}-classes")
            metrics.update({f"{setup.class_scope}_{name}": value for name, value in seen_metrics.items()})
        return metrics

    ensemble = evaluation_ensemble(model)  # ConDU's task experts and semantic voting (`hf_ccl.evaluation.ensemble`)
    if ensemble is not None:
        def embed(names: list[str]) -> torch.Tensor:
            return zero_shot_classifier(model, names, templates, tokenizer, batch_size=batch_size,
                                        max_length=max_length)

        candidates = [(class_names, task.name)] + ([] if seen_labels is None else [(seen, None)])  # no task id
        voted = ensemble_scores(model, ensemble,
                                lambda: _encode_eval_images(model, task, image_processor, batch_size, None),
                                embed, candidates)
        if voted is not None:
            metrics = accuracy_from_scores(voted[0], labels)
            if seen_labels is not None:
                scoped = accuracy_from_scores(voted[1], seen_labels)
                metrics.update({f"{setup.class_scope}_{name}": value for name, value in scoped.items()})
            return metrics

    router = evaluation_router(model)
    if router is not None:
        routed = _routed_classification(model, router, task, image_processor, batch_size, score)
        if routed is not None:
            return routed
    return score(_encode_eval_images(model, task, image_processor, batch_size, cache), slice(None))


def _routed_classification(
    model: torch.nn.Module, router: EvaluationRouter, task: Task, image_processor: Any, batch_size: int,
    score: Callable[[torch.Tensor, torch.Tensor], dict[str, float]],
) -> dict[str, float] | None:
    """Score each route's images with that route's image and class embeddings (`hf_ccl.evaluation.routing`); the
    metrics are the routes' example-weighted means, plus each route's share. None when evaluation is not routed."""
    with router.evaluation_route(model, -1):
        frozen = _encode_eval_images(model, task, image_processor, batch_size, None)
    routes = router.evaluation_routes(torch.nn.functional.normalize(frozen, dim=-1))
    if routes is None:
        return None
    routes = routes.cpu()
    totals: dict[str, float] = {}
    for route, rows in route_groups(routes):
        subset = dataclasses.replace(task, eval=task.eval.select(rows))
        with router.evaluation_route(model, route):
            metrics = score(_encode_eval_images(model, subset, image_processor, batch_size, None), torch.tensor(rows))
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value * len(rows) / routes.numel()
    return {**totals, **routing_metrics(routes)}


def evaluate_task(
    model: torch.nn.Module,
    task: Task,
    image_processor: Any,
    tokenizer: Any,
    *,
    batch_size: int = 256,
    max_length: int | None = None,
    chunk_size: int = 1024,
    cache: CacheSession | None = None,
    seen_class_names: Sequence[str] | None = None,
    class_scope: str = "seen",
) -> dict[str, float]:
    """All metrics of `model` on `task.eval`, always including `task.headline_metric`.

    Retrieval tasks: `recall_at_k` over every eval image and all of its captions (`i2t_R@K`, `t2i_R@K`, `R_mean`);
    identical captions are one text, a positive of every image they describe, and ties count in expectation.
    Classification tasks: zero-shot accuracy among `task.class_names` with the `task.eval_templates` ensemble
    (default `["a photo of a {label}."]`): `accuracy`, `top5_accuracy` when there are more than 5 classes; with
    `seen_class_names` (the task-agnostic protocol, `hf_ccl.class_prompts.seen_class_names`) also `seen_accuracy`
    (and `seen_top5_accuracy`), among those classes with the task's own templates; `class_scope="all"` names those
    metrics `all_accuracy` (`all_top5_accuracy`): the X-TAIL protocol, candidates from every task of the stream.
    Pair tasks (encoded by `hf_ccl.pair_features`): Recall@K between their two modalities' learner outputs, and
    the drift of their alignment matrix once learned (`hf_ccl.evaluation.pairs`). Each task's kind scores it
    (`Task.kind_spec.evaluate`, `hf_ccl.data.kinds`), so a registered kind of one's own is scored its own way.
    With `cache` (an `EmbeddingCache.session` of this model), embeddings whose producers did not change since they
    were computed are reused (`hf_ccl.evaluation.cache`). The model's training mode is restored afterwards.
    Non-finite embeddings (a diverged model) raise `NonFiniteEmbeddingError` naming the task, never a score.
    """
    setup = EvalSetup(image_processor, tokenizer, batch_size=batch_size, max_length=max_length,
                      chunk_size=chunk_size, cache=cache, seen_class_names=seen_class_names,
                      class_scope=class_scope)
    try:
        metrics = task.kind_spec.evaluate(model, task, setup)
    except NonFiniteEmbeddingError as error:
        raise NonFiniteEmbeddingError(f"task {task.name!r}, eval split: {error}") from error
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
    cache: EmbeddingCache | None = None,
) -> dict[str, dict[str, float]]:
    """`evaluate_task` on every task (a `TaskStream` or a list of `Task`), keyed by task name in stream order; with
    `cache`, embeddings that cannot have changed since an earlier call are reused."""
    session = None if cache is None else cache.session(
        model, tokenizer, image_processor, batch_size=batch_size, max_length=max_length)
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
            cache=session,
        )
    return results
