"""The package reads as a request's path: its layers import one way, the ledger's arithmetic reads
nothing above it, and no folder is a corridor of modules (STYLE.md, "Our shape").

Every `import` statement counts, including the ones inside functions. The router's own sub-layers
are checked in tests/router/test_router_layout.py, the planner's in tests/sim/test_layering.py.
"""

from __future__ import annotations

from pathlib import Path

import pdserve
from tests.helpers.imports import pdserve_imports

ROOT = Path(pdserve.__file__).resolve().parent
REQUEST_PATH = ("api", "router", "workers", "handoff", "engine", "model")  # each imports only those to its right
MAX_MODULES = 20


def _imports_by_package() -> dict[str, set[tuple[str, str]]]:
    """Top-level package -> (module path, imported pdserve package) for every import that leaves it."""
    found: dict[str, set[tuple[str, str]]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if len(rel.parts) < 2:
            continue
        package = rel.parts[0]
        for name in pdserve_imports(path):
            target = name.split(".")[1]
            if target != package:
                found.setdefault(package, set()).add((str(rel), target))
    return found


def test_the_request_path_imports_only_downwards():
    imports = _imports_by_package()

    for package in REQUEST_PATH:
        for module, target in imports.get(package, ()):
            if target in REQUEST_PATH:
                assert REQUEST_PATH.index(target) > REQUEST_PATH.index(package), \
                    f"{module} imports pdserve.{target}, which is above {package}/ on the request's path"
    assert {t for _, t in imports["router"]} >= {"workers", "handoff", "engine"}  # the walk saw the path


def test_the_ledger_reads_no_other_package():
    assert not _imports_by_package().get("ledger"), "ledger/ is the arithmetic every layer reads; it imports none"


def test_no_folder_is_a_corridor():
    folders = [p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists()]
    crowded = {}
    for folder in [ROOT, *folders]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if not 1 <= len(modules) <= MAX_MODULES:
            crowded[str(folder.relative_to(ROOT.parent))] = len(modules)

    assert len(folders) >= 20  # the walk saw the sub-packages
    assert not crowded, f"folders outside 1..{MAX_MODULES} modules (group them by job): {crowded}"
