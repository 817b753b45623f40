"""Saving and loading method state beside a checkpoint (`method_state.json` / `.safetensors`), through the state
protocol shared with the task callbacks (`hf_ccl.state_files`); each entry also records the method's config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..state_files import load_states, save_states
from .base import ContinualMethod
from .loading import checkpoint_folder

if TYPE_CHECKING:
    from ..modeling import ContinualDualEncoder

MethodT = TypeVar("MethodT", bound=ContinualMethod[Any])

STATE_STEM = "method_state"
STATE_JSON = f"{STATE_STEM}.json"
STATE_TENSORS = f"{STATE_STEM}.safetensors"


def save_method_states(methods: list[ContinualMethod], directory: str | Path) -> None:
    """Every method's `state_dict()` (with its config) in `directory`."""
    save_states({method.name: method for method in methods}, directory, STATE_STEM,
                extra={method.name: {"config": method.config.to_dict()} for method in methods})


def load_method_states(methods: list[ContinualMethod], directory: str | Path) -> None:
    """Restore every method's state from `directory`; a missing or unreadable file, a tensor the JSON refers to that
    the tensor file lacks, or a state without an entry its method needs is an error naming the file and the entry."""
    load_states({method.name: method for method in methods}, directory, STATE_STEM, what="method")


def load_checkpoint_method(method_class: type[MethodT], name_or_path: str | Path, revision: str | None = None
                           ) -> tuple[MethodT, ContinualDualEncoder]:
    """(the method as a task checkpoint's method state left it, the checkpoint's model): what a `CheckpointLoader`
    function starts from before it attaches the method's part of the evaluated model. `name_or_path`: a task folder
    or a Hub repository id with its `revision` (`checkpoint_folder`). Refused: a checkpoint without that method."""
    from ..families import load_continual_model

    folder = checkpoint_folder(name_or_path, revision)
    states = json.loads((folder / STATE_JSON).read_text(encoding="utf-8"))
    name = method_class.name
    if name not in states:
        raise ValueError(f"{folder / STATE_JSON} holds no '{name}' state (methods: {sorted(states)})")
    method = method_class(states[name]["config"])
    load_method_states([method], folder)
    return method, load_continual_model(str(folder))
