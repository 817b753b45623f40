"""The names of the registered methods, named streams and model families, read from hf_ccl's source without
importing it (importing a method imports torch and transformers: seconds). `hf-ccl list` and `hf-ccl train --help`
use these.

A plugin still registers itself by being imported (`@register_method`, `@register("name")`); these functions find
the same names by parsing the files (`ast`). Where a file says something they cannot read (a name computed at
import), they import the registry instead, so the answer is always the registry's (a test checks they agree).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


class _Unreadable(Exception):
    """The source names a plugin in a way only importing it can tell."""


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return found


def _text(node: ast.expr, constants: dict[str, str]) -> str:
    """A string literal, or a module constant holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    raise _Unreadable(ast.dump(node))


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _assignment(statement: ast.stmt) -> tuple[list[str], ast.expr | None]:
    """The names a statement assigns (`x = ...`, `x: T = ...`) and the value; ([], None) for any other statement."""
    if isinstance(statement, ast.Assign):
        return [t.id for t in statement.targets if isinstance(t, ast.Name)], statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return [statement.target.id], statement.value
    return [], None


def _class_attribute(node: ast.ClassDef, attribute: str, constants: dict[str, str]) -> str | None:
    for item in node.body:
        names, value = _assignment(item)
        if attribute in names and value is not None:
            return _text(value, constants)
    return None


def _scan_methods() -> list[str]:
    names = []
    for path in sorted((PACKAGE / "methods").glob("*.py")):
        tree = _tree(path)
        constants = _constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_decorator_name(d) == "register_method" for d in node.decorator_list):
                name = _class_attribute(node, "name", constants)
                if name is None:  # inherited: only the class hierarchy tells
                    raise _Unreadable(node.name)
                names.append(name)
    return sorted(names)


def _scan_streams() -> list[str]:
    names = []
    for path in sorted((PACKAGE / "data").glob("*.py")):
        tree = _tree(path)
        if not _imports_stream_register(tree):
            continue
        constants = _constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    if isinstance(decorator, ast.Call) and _decorator_name(decorator) == "register":
                        names.append(_text(decorator.args[0], constants) if decorator.args else _unreadable())
    return sorted(names)


def _imports_stream_register(tree: ast.Module) -> bool:
    """Whether the module imports `register` from `stream_registry` (the decorator of named streams)."""
    return any(isinstance(node, ast.ImportFrom) and (node.module or "").endswith("stream_registry")
               and any(alias.name == "register" and alias.asname is None for alias in node.names)
               for node in tree.body)


def _scan_families() -> list[str]:
    """The `family` of each class in `families.FAMILIES`' list of classes (defined in families.py or modeling.py)."""
    families_tree = _tree(PACKAGE / "families.py")
    listed: list[str] = []
    for node in families_tree.body:
        names, value = _assignment(node)
        if "FAMILIES" in names and value is not None:
            listed = [n.id for n in ast.walk(value) if isinstance(n, ast.Name) and n.id[:1].isupper()]
    family: dict[str, str] = {}
    for tree in (families_tree, _tree(PACKAGE / "modeling.py")):
        constants = _constants(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                name = _class_attribute(node, "family", constants)
                if name is not None:
                    family[node.name] = name
    if not listed or any(name not in family for name in listed):
        raise _Unreadable("FAMILIES")
    return [family[name] for name in listed]


def _unreadable() -> str:
    raise _Unreadable("register() without a name")


@cache
def method_names() -> tuple[str, ...]:
    """Every built-in method's registered name, sorted (`hf_ccl.methods.available_methods()`)."""
    try:
        return tuple(_scan_methods())
    except (_Unreadable, SyntaxError, OSError):
        from .methods import available_methods

        return tuple(available_methods())


@cache
def stream_names() -> tuple[str, ...]:
    """Every named stream, sorted (the keys of `hf_ccl.data.NAMED_STREAMS`)."""
    try:
        return tuple(_scan_streams())
    except (_Unreadable, SyntaxError, OSError):
        from .data import NAMED_STREAMS

        return tuple(sorted(NAMED_STREAMS))


@cache
def family_names() -> tuple[str, ...]:
    """Every supported model family, in `hf_ccl.families.FAMILIES`' order."""
    try:
        return tuple(_scan_families())
    except (_Unreadable, SyntaxError, OSError):
        from .families import FAMILIES

        return tuple(FAMILIES)
