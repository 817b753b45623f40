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


def _references(value: Any) -> list[str]:
    """Every tensor reference in a nested structure written by `_split`."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return [value[_TENSOR_REF]]
        return [ref for v in value.values() for ref in _references(v)]
    if isinstance(value, list):
        return [ref for v in value for ref in _references(v)]
    return []


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
    """Restore every method's state from `directory`; a missing or unreadable file, a tensor the JSON refers to that
    the tensor file lacks, or a state without an entry its method needs is an error naming the file and the entry."""
    directory = Path(directory)
    json_path = directory / STATE_JSON
    try:
        states = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read method state {json_path}: {error}") from error
    if not isinstance(states, dict):
        raise ValueError(f"{json_path} is not a mapping of method names to states (damaged or edited)")
    tensor_path = directory / STATE_TENSORS
    try:
        tensors = load_file(str(tensor_path)) if tensor_path.exists() else {}
    except Exception as error:
        raise ValueError(f"Cannot read method state tensors {tensor_path}: {error}") from error
    for method in methods:
        if not isinstance(states.get(method.name), dict) or "state" not in states[method.name]:
            raise ValueError(f"{json_path} holds no state for method {method.name!r} (has: {sorted(states)})")
        state = states[method.name]["state"]
        absent = [ref for ref in _references(state) if ref not in tensors]
        if absent and not tensor_path.exists():
            raise ValueError(f"Method state file {tensor_path} is missing ({json_path} refers to "
                             f"{len(absent)} tensor(s) in it, e.g. {absent[0]!r}): restore it, or remove that "
                             "checkpoint to resume from an earlier one")
        if absent:
            raise ValueError(f"{tensor_path} lacks tensor(s) {absent[:3]} of method {method.name!r} that {json_path} "
                             "refers to (the two files are from different saves?)")
        try:
            method.load_state_dict(_join(state, tensors))
        except KeyError as error:  # a state of another layout (another hf_ccl version, or edited)
            raise ValueError(f"{json_path}: the state of method {method.name!r} lacks the entry {error}: it was "
                             "written by another version of the method or changed; resume from a checkpoint this "
                             "version wrote") from error
