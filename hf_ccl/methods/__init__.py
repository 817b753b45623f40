"""Continual-learning methods as composable plugins, and their registry."""

from . import (  # noqa: F401  (registers the built-in methods)
    cllclip,
    ctp,
    dns,
    ewc,
    finetune,
    joint,
    lora,
    lwf,
    mas,
    modx,
    patching,
    prompt,
    replay,
    si,
    teir,
    tic,
    tic_replay,
    vocab,
)
from .base import ContinualMethod, MethodConfig, TaskContext
from .registry import (
    METHODS,
    available_methods,
    build_methods,
    check_combination,
    check_methods,
    get_method_class,
    register_method,
)
from .state import load_method_states, save_method_states

__all__ = [
    "METHODS",
    "ContinualMethod",
    "MethodConfig",
    "TaskContext",
    "available_methods",
    "build_methods",
    "check_combination",
    "check_methods",
    "get_method_class",
    "load_method_states",
    "register_method",
    "save_method_states",
]
