"""The router process's side of TetriInfer admission (`--reserve`, `--predictor`).

Contract (one `TetriRuntime` per `ClusterBackend`; called on the backend's event loop):
- `hold(req)`: the request's output hold (router/tetri/reserve_mode.py; a pure function of the
  request, computed once, so every admission attempt and the recompute fallback see the same bound); `output_demand(req)` the output
  tokens the router's decode hold covers (n sequences, plus the partial block each fork copies);
  `reserve_tokens(req)` what `ReserveKv` tells the decode worker to reserve (0: max_tokens).
- `on_tokens(live, worker_id, item)`: every token message from the request's decode worker
  carries its cumulative (blocks grown past the hold, preemptions) (workers/hold_watch.py); a
  rise in grown blocks grows the route's hold in the router's ledger (`Router.grow_hold`) and is
  counted, a rise in preemptions is counted; the request's last message scores its prediction
  (covered / under / over and the bytes, `reserve_mode.outcome_bytes`). The trace line gets
  `reserve_mode`, `reserve_tokens`, `predicted_bucket`, `hold_grown_blocks`, `preemptions`,
  `prediction`.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.ledger.kv import fork_blocks
from pdserve.router.tetri.reserve_mode import OutputHold, ReservePolicy, outcome_bytes

CACHE = 8192


class TetriRuntime:
    def __init__(self, backend, policy: ReservePolicy = ReservePolicy()):
        self.backend, self.policy = backend, policy
        self._holds: OrderedDict[tuple[str, int], OutputHold] = OrderedDict()
        backend.metrics.reservations.mode.labels(policy.mode).set(1)

    @property
    def mode(self) -> str:
        return self.policy.mode

    def hold(self, req) -> OutputHold:
        """Predicted once per request (a prediction costs ~0.5 ms; a request waiting in admission
        asks on every attempt); the last `CACHE` requests' holds are kept."""
        key = (req.request_id, id(req))
        hold = self._holds.get(key)
        if hold is None:
            hold = self._holds[key] = self.policy.hold(req.prompt_ids, req.params.max_tokens)
            if len(self._holds) > CACHE:
                self._holds.popitem(last=False)
        return hold

    def output_demand(self, req, block_size: int, max_model_len: int) -> int:
        """Tokens past the prompt the router's decode hold covers: the hold for one choice; for n
        choices the decode worker's own block count (ledger/kv.py `fork_blocks`: each choice's
        growth and the partial prompt block each fork copies), as tokens, so the router's blocks
        (demand.decode_blocks) are the ones the worker reserves."""
        n, tokens = req.params.n, self.hold(req).tokens
        if n == 1:
            return tokens
        prompt = len(req.prompt_ids)
        prompt_blocks, growth, _ = fork_blocks(prompt, tokens, n, block_size, max_model_len)
        return (prompt_blocks + growth) * block_size - prompt

    def reserve_tokens(self, req) -> int:
        return self.hold(req).tokens if self.policy.mode == "dynamic" else 0

    def note_route(self, live) -> None:
        hold = self.hold(live.req)
        live.note(reserve_mode=self.policy.mode, reserve_tokens=hold.tokens)
        if hold.prediction is not None:
            live.note(predicted_bucket=hold.prediction.bucket, predicted_upper_tokens=hold.prediction.upper_tokens)

    def on_tokens(self, live, worker_id: str, item) -> None:
        metrics = self.backend.metrics.reservations
        grown = item.hold_grown_blocks - live.trace.get("hold_grown_blocks", 0)
        if grown > 0 and worker_id == live.decode_id:
            self.backend.router.grow_hold(live.req.request_id, worker_id, grown)
            metrics.growths.inc()
            metrics.growth_blocks.inc(grown)
            live.note(hold_grown_blocks=item.hold_grown_blocks)
        preempted = item.preemptions - live.trace.get("preemptions", 0)
        if preempted > 0:
            metrics.preemptions.inc(preempted)
            live.note(preemptions=item.preemptions)
        if item.finished:
            self._score(live)
            self._holds.pop((live.req.request_id, id(live.req)), None)

    def _score(self, live) -> None:
        prediction = self.hold(live.req).prediction
        if prediction is None:
            return
        bytes_per_token = self.backend._bytes_per_token()
        outcome, under, over = outcome_bytes(len(live.output_ids), prediction, self.policy.predictor.manifest.buckets,
                                             bytes_per_token)
        self.backend.metrics.reservations.observe(outcome, under, over)
        live.note(prediction=outcome)
