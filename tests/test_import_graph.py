"""The import graph of `hf_ccl/`, read from the source (AST, nothing imported): no circle, and no module importing a
layer above its own.

Every import counts: at module level, under `if TYPE_CHECKING:`, and inside functions (a lazy import is still a
dependency). A module may import its own layer and the layers below; a circle inside one layer fails as well.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_ccl"

#: From the top down. An entry names a module, or a package with everything in it (`hf_ccl.methods`); the root
#: package `hf_ccl` (the public API, which imports everything lazily) is itself only. A new module goes into the
#: lowest layer that holds everything it imports. `callbacks` is the callbacks' protocol (`TaskCallback`, no
#: imports); the built-in callbacks live beside their code (`hub`, `cards` above, `compute` and
#: `evaluation.spatial_disorder` in the components). (`catalog`: a module another change of issue 27 adds, placed
#: ahead.)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("hf_ccl", "hf_ccl.cli", "hf_ccl.run", "hf_ccl.testing")),
    ("the loop", ("hf_ccl.continual", "hf_ccl.config")),
    ("the loop's parts", ("hf_ccl.trainer", "hf_ccl.checkpointing", "hf_ccl.run_state", "hf_ccl.cards", "hf_ccl.hub",
                          "hf_ccl.eval_results",
                          "hf_ccl.stream_logging", "hf_ccl.resume_settings", "hf_ccl.run_folder", "hf_ccl.checks")),
    ("components", ("hf_ccl.methods", "hf_ccl.evaluation", "hf_ccl.metrics", "hf_ccl.data", "hf_ccl.modeling",
                    "hf_ccl.families", "hf_ccl.processors", "hf_ccl.tokenization", "hf_ccl.tokenization_unigram",
                    "hf_ccl.class_prompts", "hf_ccl.pair_features", "hf_ccl.compute", "hf_ccl.heads", "hf_ccl.losses",
                    "hf_ccl.accumulation", "hf_ccl.step_meter", "hf_ccl.catalog", "hf_ccl.sharding")),
    ("utilities", ("hf_ccl.callbacks", "hf_ccl.state_files", "hf_ccl.checkpoint_files", "hf_ccl.distributed",
                   "hf_ccl.files", "hf_ccl.paths", "hf_ccl.safe_yaml", "hf_ccl.validation", "hf_ccl.training_options",
                   "hf_ccl.version", "hf_ccl.arguments", "hf_ccl.training_defaults")),
]


def module_files(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's `__init__`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (anywhere in its source). `from x import name` depends on
    the submodule `x.name` when there is one, else on `x`."""
    modules = module_files(package)
    root = package.name

    def known(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names if alias.name.split(".")[0] == root)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != root:
                    continue
                targets.update(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base)
                               for alias in node.names)
        graph[name] = targets - {name}
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import circle as `[a, b, ..., a]`, or None (depth-first search)."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node):], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int:
    """Index of the layer (0 = top) whose longest entry names `module` or a package holding it."""
    best, index = -1, None
    for position, (_, entries) in enumerate(layers):
        for entry in entries:
            inside = module == entry or (entry != PACKAGE.name and module.startswith(entry + "."))
            if inside and len(entry) > best:
                best, index = len(entry), position
    if index is None:
        raise LookupError(f"module {module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return index


def upward_imports(graph: Mapping[str, Iterable[str]],
                   layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Every import of a module from a layer above its own, as readable lines."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target, layers) < layer_of(module, layers):
                found.append(f"{module} ({layers[layer_of(module, layers)][0]}) imports {target} "
                             f"({layers[layer_of(target, layers)][0]})")
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_package_has_no_import_circle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle or [])}"


def test_every_module_has_a_layer_and_imports_nothing_above_it(graph):
    unplaced = [module for module in graph if _unplaced(module)]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    assert upward_imports(graph) == []


def test_the_graph_sees_every_kind_of_import(graph):
    """Module level, relative, `TYPE_CHECKING` and function-local imports are all edges (read from today's code)."""
    assert "hf_ccl.checkpointing" in graph["hf_ccl.continual"]  # `from . import checkpointing`
    assert "hf_ccl.methods.base" in graph["hf_ccl.methods.state"]  # `from .base import ...` in a subpackage
    assert "hf_ccl.continual" in graph["hf_ccl"]  # under `if TYPE_CHECKING:`
    assert "hf_ccl.state_files" in graph["hf_ccl.callbacks"]  # inside a function


def test_a_circle_and_an_upward_import_are_named():
    """The checks can fail: a synthetic graph with a circle (and an upward edge) is reported, naming the modules."""
    synthetic = {"hf_ccl.checkpointing": {"hf_ccl.continual"}, "hf_ccl.continual": {"hf_ccl.checkpointing"},
                 "hf_ccl.files": set()}
    assert find_cycle(synthetic) == ["hf_ccl.checkpointing", "hf_ccl.continual", "hf_ccl.checkpointing"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert upward_imports(synthetic) == ["hf_ccl.checkpointing (the loop's parts) imports hf_ccl.continual (the loop)"]
    with pytest.raises(LookupError, match="hf_ccl.new_module is in no layer"):
        layer_of("hf_ccl.new_module")


def _unplaced(module: str) -> bool:
    try:
        layer_of(module)
    except LookupError:
        return True
    return False
