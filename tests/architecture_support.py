"""What the architecture tests share: which `if` never runs, and the import cycles of a graph."""

from __future__ import annotations

import ast


def is_type_checking(node: ast.If) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports there never run."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def all_cycles(graph: dict[str, set[str]], limit: int = 20) -> list[str]:
    """Every cycle, not only the first ("a -> b -> a"): each one found loses its closing edge
    (in a copy) and the search goes on, so one failure lists all the work."""
    graph = {node: set(deps) for node, deps in graph.items()}
    cycles: list[str] = []
    while len(cycles) < limit and (found := find_cycle(graph)) is not None:
        cycles.append(" -> ".join(found))
        graph[found[-2]].discard(found[-1])
    return cycles
