"""router/ reads by job: sub-packages that import one way, no import circles, no crowded folder
(issue 38, part 1).

Every `import` statement counts, including the ones inside functions. The order of the layers is
the order in which a request's route is decided: the shared vocabulary, then prices, where K/V
lives, what the router knows, the policies, the schedulers' additions (TetriInfer, Splitwise),
the facade that composes them, the process edge that drives the facade, and KV-Runahead's chains
on top of the edge. A module may import only from its own layer or those to its left.
"""

from __future__ import annotations

from pathlib import Path

import pdserve
from tests.helpers.imports import assert_no_circles, pdserve_imports

ROOT = Path(pdserve.__file__).resolve().parent
ROUTER = ROOT / "router"
BASE = {"messages", "errors", "contract", "kernels"}  # top-level modules every layer may read
FACADE = {"router", "config", "answers", "synthetic"}  # top-level modules that compose the layers
LAYERS = ("base", "pricing", "kv", "state", "policy", "tetri", "splitwise", "facade", "process", "runahead")


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _layer(module: str) -> str:
    parts = module.split(".")[2:]  # after pdserve.router
    if not parts:
        return "facade"
    if len(parts) == 1 and parts[0] in BASE | FACADE:
        return "base" if parts[0] in BASE else "facade"
    return parts[0]


def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in ROUTER.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = pdserve_imports(path)
        graph[name] = {m for m in found if m in modules and m != name and not modules[m].name == "__init__.py"}
    return graph


def test_every_router_module_has_a_layer():
    for module in _graph():
        assert _layer(module) in LAYERS, f"{module}: put it in one of {LAYERS} (or name it in this test)"


def test_router_layers_import_only_downwards():
    for module, targets in _graph().items():
        for target in targets:
            assert LAYERS.index(_layer(target)) <= LAYERS.index(_layer(module)), \
                f"{module} ({_layer(module)}) imports {target} ({_layer(target)}), an upper layer"


def test_no_import_circles_in_the_router():
    graph = _graph()

    assert_no_circles(graph)
    assert len(graph) >= 50


def test_no_router_folder_is_crowded():
    for folder in [ROUTER, *(p for p in ROUTER.iterdir() if p.is_dir() and (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert 1 <= len(modules) <= 20, f"{folder.relative_to(ROOT)} holds {len(modules)} modules"
