"""Saving and loading method state beside a checkpoint (`method_state.json` / `.safetensors`), through the state
protocol shared with the task callbacks (`hf_ccl.state_files`); each entry also records the method's config."""

from __future__ import annotations

from pathlib import Path

from ..state_files import load_states, save_states
from .base import ContinualMethod

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
