"""Every `pdserve.*` name a module imports, for the layering tests (tests/sim/test_layering.py,
tests/router/test_router_layout.py). Every `import` statement counts, including the ones inside
functions: a deferred import that closes a circle is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path


def pdserve_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("pdserve.")}


def assert_no_circles(graph: dict[str, set[str]]) -> None:
    """Depth-first over `graph` (module -> the modules it imports); fails naming the first circle."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]) \
                if nxt in path else f"import circle: {node} -> {nxt}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
