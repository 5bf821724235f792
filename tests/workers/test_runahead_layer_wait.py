"""A KV-Runahead stage's forward waits, after each layer, until the NEXT layer of its prefix has
landed (workers/runahead_side.py), and a link that aborts breaks the step instead of letting it
compute over missing K/V."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pdserve.engine.outputs import PrefillProgress
from pdserve.handoff.states import TxnState
from pdserve.workers.runahead_side import ChainBroken, Link, RunaheadSide, landed_layers, layer_landed

LAYERS = 3


def _txn(accepted=()):
    chunks = [SimpleNamespace(chunk_id=f"L{layer}c{c}", layer=layer) for layer in range(LAYERS) for c in range(2)]
    manifest = SimpleNamespace(chunks=chunks, abi=SimpleNamespace(num_layers=LAYERS))
    return SimpleNamespace(manifest=manifest, accepted={cid: 1 for cid in accepted}, state=TxnState.TRANSFERRING)


def test_landed_layers_counts_leading_complete_layers():
    assert landed_layers(None) == 0 and landed_layers(SimpleNamespace(manifest=None)) == 0
    assert landed_layers(_txn(["L0c0"])) == 0
    assert landed_layers(_txn(["L0c0", "L0c1", "L2c0", "L2c1"])) == 1  # layer 2 early does not count
    assert landed_layers(_txn([f"L{l}c{c}" for l in range(LAYERS) for c in range(2)])) == LAYERS
    txn = _txn(["L0c0", "L0c1"])
    assert layer_landed(txn, 0) and not layer_landed(txn, 1) and layer_landed(txn, LAYERS)


def _side(txn) -> tuple[RunaheadSide, Link]:
    side = object.__new__(RunaheadSide)  # only the waiting machinery: no engine, no listener
    side.landed, side.wait_s = threading.Condition(), 60.0
    side.endpoint = SimpleNamespace(transfers={"t": txn})
    link = Link(SimpleNamespace(transfer_id="t"), "res", txn, time.monotonic())
    link.admitted = True
    side.links = {"r": link}
    return side, link


def _land(side, txn, *chunk_ids):
    with side.landed:
        txn.accepted.update({cid: 1 for cid in chunk_ids})
        side.landed.notify_all()


def test_the_hook_after_layer_l_waits_for_layer_l_plus_1():
    txn = _txn(["L0c0", "L0c1"])
    side, _ = _side(txn)
    marked = []
    hook = side.wrap(lambda layer, progress: marked.append(layer))
    progress = (PrefillProgress("r", 8, True),)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (hook(0, progress), done.set()))
    thread.start()
    assert not done.wait(0.3)  # layer 1 has not landed: the forward must not go on
    assert marked == [0]  # the onward transfer was told about layer 0 first
    _land(side, txn, "L1c0")
    assert not done.wait(0.2)  # half of layer 1 is not enough
    _land(side, txn, "L1c1")
    assert done.wait(5)
    thread.join()
    hook(LAYERS - 1, progress)  # after the last layer nothing more is needed


def test_an_aborted_link_breaks_the_step():
    txn = _txn(["L0c0", "L0c1"])
    side, _ = _side(txn)
    hook = side.wrap(None)
    errors = []

    def run():
        try:
            hook(0, (PrefillProgress("r", 8, True),))
        except ChainBroken as exc:
            errors.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.1)
    with side.landed:
        txn.state = TxnState.ABORTED
        side.landed.notify_all()
    thread.join(5)
    assert len(errors) == 1 and errors[0].request_id == "r"
    with pytest.raises(ChainBroken):
        side.wrap(None)(1, (PrefillProgress("r", 8, True),))
