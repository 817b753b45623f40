"""The state protocol's files: the `state_dict()` of methods and task callbacks, saved beside a checkpoint.

Anything with state that must survive a restart implements `state_dict()` / `load_state_dict(state)` (the
`Stateful` protocol, as a torch module does): a nested dict of tensors and JSON values. `save_states` writes the
states of several named owners into `<stem>.json` (every tensor replaced by a reference) and `<stem>.safetensors`
(the tensors); `load_states` gives each owner its state back, and every problem is an error naming the file and the
entry. The methods' states go to `method_state.*` (`hf_ccl.methods.state`), the task callbacks' to
`callback_state.*` (`hf_ccl.callbacks`); `hf_ccl.checkpointing.save_states` / `restore_states` do both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

_TENSOR_REF = "__tensor__"


@runtime_checkable
class Stateful(Protocol):
    """What must survive a restart: tensors (saved as safetensors) and JSON values, in a nested dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


def save_states(
    owners: Mapping[str, Stateful], directory: str | Path, stem: str,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write every owner's `state_dict()` to `<stem>.json` as `{name: {"state": ..., **extra[name]}}` (tensors
    replaced by references) and its tensors to `<stem>.safetensors` (only when there are tensors)."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    entries = {name: {**(extra or {}).get(name, {}), "state": _split(owner.state_dict(), name, tensors)}
               for name, owner in owners.items()}
    # (in the order of the states themselves: a restored dict iterates as the saved one did)
    (directory / f"{stem}.json").write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
    if tensors:
        save_file(tensors, str(directory / f"{stem}.safetensors"))


def load_states(owners: Mapping[str, Stateful], directory: str | Path, stem: str, what: str = "method",
                required: bool = True) -> None:
    """Give every owner its state from `<stem>.json` / `<stem>.safetensors` in `directory` (`what` names the kind of
    owner in errors). A missing or unreadable file, a tensor the JSON refers to that the tensor file lacks, or a
    state without an entry its owner needs is an error naming the file and the entry; an owner the file holds no
    state for is an error (`required`) or keeps its initial state, with a warning."""
    directory = Path(directory)
    json_path, tensor_path = directory / f"{stem}.json", directory / f"{stem}.safetensors"
    try:
        entries = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {what} state {json_path}: {error}") from error
    if not isinstance(entries, dict):
        raise ValueError(f"{json_path} is not a mapping of {what} names to states (damaged or edited)")
    try:
        tensors = load_file(str(tensor_path)) if tensor_path.exists() else {}
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise ValueError(f"Cannot read {what} state tensors {tensor_path}: {error}") from error
    for name, owner in owners.items():
        if not isinstance(entries.get(name), dict) or "state" not in entries[name]:
            message = f"{json_path} holds no state for {what} {name!r} (has: {sorted(entries)})"
            if required:
                raise ValueError(message)
            logger.warning("%s: it starts from its initial state", message)
            continue
        state = entries[name]["state"]
        absent = [ref for ref in _references(state) if ref not in tensors]
        if absent and not tensor_path.exists():
            raise ValueError(f"{what.capitalize()} state file {tensor_path} is missing ({json_path} refers to "
                             f"{len(absent)} tensor(s) in it, e.g. {absent[0]!r}): restore it, or remove that "
                             "checkpoint to resume from an earlier one")
        if absent:
            raise ValueError(f"{tensor_path} lacks tensor(s) {absent[:3]} of {what} {name!r} that {json_path} "
                             "refers to (the two files are from different saves?)")
        try:
            owner.load_state_dict(_join(state, tensors))
        except KeyError as error:  # a state of another layout (another hf_ccl version, or edited)
            raise ValueError(f"{json_path}: the state of {what} {name!r} lacks the entry {error}: it was written "
                             f"by another version of the {what} or changed; resume from a checkpoint this version "
                             "wrote") from error
