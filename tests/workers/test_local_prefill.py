"""Local prefills on a decode worker (workers/local_prefill.py) over a real tiny engine."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.workers.local_prefill import LocalPrefills


def test_a_decode_worker_reports_its_local_prefill_until_it_decodes():
    engine = Engine(EngineConfig(model="tiny", num_blocks=64, max_num_batched_tokens=32))
    local = LocalPrefills("decode")
    local.accept("r1")
    engine.add_request("r1", list(range(3, 103)), SamplingParams(max_tokens=4, ignore_eos=True), seed=1)
    assert local.load(engine) == (1, 100)
    engine.step()  # one chunk of the 32-token budget
    assert local.load(engine) == (1, 68)
    while engine.has_unfinished() and local.load(engine)[0]:
        engine.step()
    assert local.load(engine) == (0, 0) and not local.request_ids  # decoding now: no longer a local prefill
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_a_prefill_worker_refuses_and_a_colocated_one_keeps_no_count():
    with pytest.raises(ValueError):
        LocalPrefills("prefill").accept("r1")
    colocated = LocalPrefills("colocated")
    colocated.accept("r1")
    assert not colocated.request_ids


def test_a_decode_worker_s_heartbeat_carries_its_local_prefill_load():
    from pdserve.workers import messages as m
    from pdserve.workers.worker import Worker, WorkerConfig

    engine = EngineConfig(model="tiny", num_blocks=64, max_num_batched_tokens=32)
    worker = Worker(WorkerConfig("d0", "decode", "tcp://127.0.0.1:9", engine=engine))  # never sends here
    try:
        worker.add_local(m.Generate("r1", tuple(range(3, 103)), SamplingParams(max_tokens=4, ignore_eos=True), seed=1))
        load = worker.heartbeat().load
        assert (load.local_prefills, load.local_prefill_tokens) == (1, 100)
        worker.abort("r1")
        load = worker.heartbeat().load
        assert (load.local_prefills, load.local_prefill_tokens) == (0, 0)
    finally:
        worker.close()
