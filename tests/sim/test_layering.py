"""The planner's four packages import one way and hold no import circles (issue 24, part 5).

Every `import` statement counts, including the ones inside functions: a deferred import that
closes a circle is still a circle.
"""

from __future__ import annotations

from pathlib import Path

import pdserve
from tests.helpers.imports import assert_no_circles, pdserve_imports

ROOT = Path(pdserve.__file__).resolve().parent
LAYERS = ("latency", "sim", "search", "validate")  # each may import only those to its left


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).glob("*.py")}
    return {name: {m for m in pdserve_imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_layers_import_only_downwards():
    for module, targets in _graph().items():
        layer = LAYERS.index(module.split(".")[1])
        for target in targets:
            assert LAYERS.index(target.split(".")[1]) <= layer, f"{module} imports {target} (an upper layer)"


def test_no_import_circles():
    graph = _graph()

    assert_no_circles(graph)
    assert len(graph) >= 25  # the four packages are all seen


def test_old_circles_are_gone():
    graph = _graph()
    assert "pdserve.latency.load" not in graph["pdserve.latency.roofline"] | graph["pdserve.latency.profiled"]
    assert "pdserve.validate.run" not in graph["pdserve.validate.points"] | graph["pdserve.validate.windows"]
    assert graph["pdserve.validate.runtime"] == set()
