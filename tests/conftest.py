"""Repository-wide test fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Make `tests.helpers` importable however pytest is launched (pytest or python -m pytest).
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in `tiny` checkpoint, generated once per session into a private temp dir."""
    from pdserve.model.default import ensure_default_model

    return ensure_default_model("tiny", cache_dir=tmp_path_factory.mktemp("pdserve-cache"))
