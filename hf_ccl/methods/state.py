"""Saving and loading method state beside a checkpoint: tensors as safetensors, the rest as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .base import ContinualMethod

STATE_JSON = "method_state.json"
STATE_TENSORS = "method_state.safetensors"
_TENSOR_REF = "__tensor__"


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor in a nested structure by a reference, collecting the tensors."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().contiguous()
        return {_TENSOR_REF: path}
    if isinstance(value, dict):
        return {str(k): _split(v, f"{path}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    return value


def _join(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def save_method_states(methods: list[ContinualMethod], directory: str | Path) -> None:
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    states = {
        m.name: {"config": m.config.to_dict(), "state": _split(m.state_dict(), m.name, tensors)} for m in methods
    }
    (directory / STATE_JSON).write_text(json.dumps(states, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tensors:
        save_file(tensors, str(directory / STATE_TENSORS))


def load_method_states(methods: list[ContinualMethod], directory: str | Path) -> None:
    """Restore every method's state from `directory`; a missing or unreadable file is an error naming it."""
    directory = Path(directory)
    json_path = directory / STATE_JSON
    try:
        states = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read method state {json_path}: {error}") from error
    tensor_path = directory / STATE_TENSORS
    try:
        tensors = load_file(str(tensor_path)) if tensor_path.exists() else {}
    except Exception as error:
        raise ValueError(f"Cannot read method state tensors {tensor_path}: {error}") from error
    for method in methods:
        if method.name not in states:
            raise ValueError(f"{json_path} holds no state for method {method.name!r} (has: {sorted(states)})")
        method.load_state_dict(_join(states[method.name]["state"], tensors))
