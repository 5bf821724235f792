"""Local prefills on a decode worker: requests whose prefill runs where they decode.

Contract: the router sends `Generate` to a decode worker when its P/D decision chose a local
prefill (router/policy/pd_decision.py), and when the decode-start fallback recomputes a request there
(router/process/recovery.py). The decode worker runs it as a NORMAL-mode engine request, so the prompt is
prefilled in aligned chunks of the engine's per-step token budget (`max_num_batched_tokens`),
and each step takes the running decode rows first and gives prefill chunks only what the budget
leaves: a local prefill never grows a step past the budget that sets the decode batch's TPOT (the
guard), it only shares it. A prefill-only worker refuses `Generate`: it has no decode side to
continue the request on (a lendable prefill worker has one: Splitwise may lend it to the token
pool, workers/roles.py). `LocalPrefills` remembers which requests came this way so each
heartbeat reports the worker's (a decode or mixed worker's) local-prefill load (requests still prefilling, their prompt
tokens not yet computed) in `Load` and `/workers`.
"""

from __future__ import annotations

from pdserve.engine.engine import Engine

ACCEPTING_ROLES = ("decode", "colocated", "mixed")


class LocalPrefills:
    """The local prefills of one decode worker; a colocated worker keeps none (every request it
    runs prefills locally: that is its ordinary path, not a P/D decision)."""

    def __init__(self, role: str, lendable: bool = False):
        self.role = role
        self.accepts = role in ACCEPTING_ROLES or lendable  # it has a decode side (workers/roles.py)
        self.request_ids: set[str] = set()

    def accept(self, request_id: str) -> None:
        """Admit a `Generate` on this worker; raises ValueError on a prefill-only worker."""
        if not self.accepts:
            raise ValueError(f"a {self.role} worker runs no whole requests (Generate {request_id})")
        if self.role != "colocated":
            self.request_ids.add(request_id)

    def load(self, engine: Engine) -> tuple[int, int]:
        """(local prefills still prefilling, their prompt tokens not yet computed); forgets the
        requests that finished, were aborted or are decoding now. Called under the engine lock."""
        prefilling, tokens = 0, 0
        for rid in list(self.request_ids):
            seq = engine.seqs.get(rid)
            if seq is None or seq.is_decoding:
                self.request_ids.discard(rid)
                continue
            prefilling += 1
            tokens += seq.num_uncomputed
        return prefilling, tokens
