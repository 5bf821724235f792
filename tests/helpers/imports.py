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
