"""Engine fixtures: small random checkpoints built with transformers, engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from tests.helpers.checkpoints import make_random_checkpoint


@pytest.fixture(scope="session")
def gqa_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA (ratio 2) checkpoint with head_dim 32 and a tokenizer-free vocab of 128."""
    return make_random_checkpoint(tmp_path_factory.mktemp("gqa"), hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=128, seed=1)


def make_engine(ckpt: Path, **overrides) -> Engine:
    cfg = dict(model=str(ckpt), dtype="float32", block_size=16, num_blocks=128, max_num_batched_tokens=256)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


@pytest.fixture
def engine_factory():
    """Builds engines and checks, after the test, that every one is back at baseline."""
    made: list[Engine] = []

    def factory(ckpt: Path, **overrides) -> Engine:
        eng = make_engine(ckpt, **overrides)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.check_integrity()
        eng.assert_no_leaks()
