"""Evaluating a model whose forward depends on a per-image route (MoE-Adapters' auto-selector, DDAS; DIKI's most
likely task, `hf_ccl.methods.diki`, whose per-image calibration weight its image tower computes inside the route).

A module of the model that implements `EvaluationRouter` (`hf_ccl.methods.moe_adapters.MoEAdapterBank`) turns the
frozen model's embedding of every eval image into a route (a task's router, or -1: the frozen model). The evaluator
then scores each route's images with the image and text embeddings of that route (the class prompts encoded once per
route, as the official MoE-Adapters evaluation does) and combines the counts, so an image and the texts it is compared
with always take the same route. `routing_metrics` adds the share of images each route took.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class EvaluationRouter(Protocol):
    """What the evaluator needs of a routed model (found among the model's modules)."""

    def evaluation_routes(self, frozen_image_embeds: torch.Tensor) -> torch.Tensor | None:
        """Routes [N] (a task's router, or -1 for the frozen model) of images from their normalised frozen
        embeddings, or None when evaluation is not routed per image."""

    def evaluation_route(self, model: nn.Module, route: int) -> AbstractContextManager[None]:
        """A block inside which every forward of `model` takes `route` (-1: the frozen model)."""


def evaluation_router(model: nn.Module) -> EvaluationRouter | None:
    """The model's evaluation router, or None (the usual case: one forward for every image)."""
    return next((module for module in model.modules() if isinstance(module, EvaluationRouter)), None)


def route_groups(routes: torch.Tensor) -> Iterator[tuple[int, list[int]]]:
    """(route, the rows that take it) for every route that occurs, in increasing order."""
    for route in torch.unique(routes).tolist():
        yield int(route), torch.nonzero(routes == route).flatten().tolist()


def routing_metrics(routes: torch.Tensor) -> dict[str, float]:
    """The share (%) of images each route took: `route_frozen` for -1, `route_<t>` for task t's router."""
    total = routes.numel()
    return {("route_frozen" if route == -1 else f"route_{route}"): 100.0 * len(rows) / total
            for route, rows in route_groups(routes)}
