"""YAML read with a bound on what its aliases expand to (configs, override values, class-order files).

`yaml.safe_load` shares an anchored value among its aliases, so a "billion laughs" document (`a: &a [x, x, ...]`,
`b: &b [*a, *a, ...]`, nested a few levels) loads in microseconds as a small graph, then blows memory and time as
soon as anything walks, copies or writes it (every check, `copy.deepcopy`, `run_config.yaml`). Here the composed
node graph is measured first, each shared node counted once per place it appears (without expanding it), and a
document whose expanded size exceeds `MAX_YAML_VALUES`, or that contains itself, is refused before it is built.
"""

from __future__ import annotations

from typing import IO, Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

#: Values (scalars, lists and mappings) a YAML document may expand to. A run config holds a few hundred; a long class
#: list or class order a few thousand. A "billion laughs" document of 9 levels of 9 aliases expands to 435 million.
MAX_YAML_VALUES = 1_000_000


class YAMLSizeError(yaml.YAMLError, ValueError):
    """A YAML document too large once its aliases are expanded, nested too deeply, or containing itself."""


def load_yaml(stream: str | IO[str], where: str, limit: int = MAX_YAML_VALUES) -> Any:
    """`yaml.safe_load(stream)`, refusing a document whose aliases expand beyond `limit` values, one that contains
    itself, or one nested too deeply for the parser; `where` names the document in the error."""
    loader = yaml.SafeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = expanded_size(node, where, limit)
        if size > limit:
            raise YAMLSizeError(
                f"{where}: its YAML aliases (*name) expand to more than {limit:,} values (a document built from "
                "repeated nested aliases, a 'billion laughs'); write the values out or use fewer nested aliases")
        return loader.construct_document(node)
    except RecursionError:
        raise YAMLSizeError(f"{where}: YAML nested too deeply to read") from None
    finally:
        loader.dispose()


def expanded_size(node: Node, where: str, limit: int = MAX_YAML_VALUES) -> int:
    """How many values `node` stands for once every alias is replaced by a copy of its anchor (counting stops a
    little past `limit`). A node that contains itself is an error naming `where`."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(current: Node) -> int:
        key = id(current)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise YAMLSizeError(f"{where}: a YAML alias refers to a value that contains it (an endless value)")
        open_nodes.add(key)
        total = 1
        if isinstance(current, SequenceNode):
            children: list[Node] = list(current.value)
        elif isinstance(current, MappingNode):
            children = [part for pair in current.value for part in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                break
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(node)
