"""Continual-learning methods as composable plugins, and their registry.

Every module of this package is imported here, so a method file registers itself (`@register_method`) by being in
the folder: adding a method is adding its one file.
"""

import importlib
import pkgutil

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

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

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
