"""API fixtures: one tiny engine behind an InProcessBackend and a uvicorn server for the session,
a second engine as the exactness reference, and a fake-backend server per test."""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager

import openai
import pytest
import torch

from pdserve.api.app import create_app
from pdserve.api.inproc import InProcessBackend
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from tests.api.servers import FakeBackend, ServerThread

MODEL = "tiny-test"
MAX_MODEL_LEN = 128


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", num_blocks=48, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=8, max_num_batched_tokens=256, num_threads=1)


class SpyBackend(InProcessBackend):
    """Counts abort calls per request id."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.abort_calls: Counter[str] = Counter()

    async def abort(self, request_id: str) -> None:
        self.abort_calls[request_id] += 1
        await super().abort(request_id)


@pytest.fixture(scope="session")
def backend(tiny_model_dir):
    torch.set_num_threads(1)
    spy = SpyBackend(Engine(engine_config(tiny_model_dir)), MODEL)
    yield spy
    spy.close()


@pytest.fixture(scope="session")
def reference_engine(tiny_model_dir) -> Engine:
    """A second engine over the same weights, driven directly (never shared with a thread)."""
    return Engine(engine_config(tiny_model_dir))


@pytest.fixture(scope="session")
def server(backend):
    srv = ServerThread(create_app(backend)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture
def tokenizer(backend):
    return backend.tokenizer()


def wait_idle(backend: InProcessBackend, timeout_s: float = 60.0) -> None:
    """Wait until the engine holds no request, then check it is back at baseline."""
    deadline = time.monotonic() + timeout_s
    while backend.run_on_engine(lambda e: e.has_unfinished()).result(timeout_s):
        if time.monotonic() > deadline:
            raise AssertionError("engine still busy")
        time.sleep(0.02)
    backend.run_on_engine(lambda e: (e.check_integrity(), e.assert_no_leaks())).result(timeout_s)


@contextmanager
def engine_held_after(backend: InProcessBackend, num_steps: int):
    """The engine thread runs `num_steps` more steps, then holds before the next one until the
    block ends (or the yielded `release()` is called): a request longer than that is still live
    until then however fast the machine generates, so an abort or a hang-up always finds it running."""
    release = threading.Event()
    steps_left = [num_steps]

    def hold(engine: Engine) -> None:
        step = engine.step

        def held_step(*args, **kwargs):
            if steps_left[0] <= 0:
                release.wait()
            steps_left[0] -= 1
            return step(*args, **kwargs)

        engine.step = held_step

    backend.run_on_engine(hold).result(60)
    try:
        yield release.set
    finally:
        release.set()
        if backend.healthy():  # a closed backend's engine steps no more
            backend.run_on_engine(lambda e: e.__dict__.pop("step", None)).result(60)  # back to the real method


@pytest.fixture
def idle_engine_after(backend):
    """Every test using it ends with the engine at baseline (no requests, no leaked blocks)."""
    yield
    wait_idle(backend)


@pytest.fixture
def fake():
    return FakeBackend()


@pytest.fixture
def fake_server(fake):
    srv = ServerThread(create_app(fake)).start()
    yield srv
    srv.stop()
