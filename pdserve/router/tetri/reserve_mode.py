"""How many output tokens a request's decode hold covers: `--reserve static|dynamic` (TetriInfer).

Contract (pure; no I/O after `load_policy`):
- static (default): the hold covers `max_tokens` per sequence, as before.
- dynamic: the hold covers the predicted bucket's upper bound a_{g+1}, capped by `max_tokens`
  (predictor/manifest.py; the upper bound is the conservative coordinate of ledger/tetri.py).
  A request that outgrows it grows its hold on the decode worker (workers/hold_watch.py reports
  it, the router's ledger records it: reservations.ReservationLedger.grow); when no block is
  free to grow into, the decode worker's scheduler preempts by recompute (engine/scheduler.py).
- `heavy`: the request counts as a heavy decode for `--decode-choice p2c` when its hold's
  output tokens reach `heavy_tokens`.
`outcome_bytes` scores a finished request against its prediction with the ledger's formulas:
covered / under / over, and the under- or over-predicted K/V bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.ledger.tetri import prediction_outcome, reservation_bounds_bytes
from pdserve.predictor.manifest import LengthPredictor, Prediction

MODES = ("static", "dynamic")


@dataclass(frozen=True)
class OutputHold:
    """The output side of one request's decode hold."""

    tokens: int  # output tokens per sequence the hold covers
    prediction: Prediction | None
    heavy: bool


@dataclass(frozen=True)
class ReservePolicy:
    mode: str = "static"
    predictor: LengthPredictor | None = None
    heavy_tokens: int = 256

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--reserve must be one of {MODES}, got {self.mode!r}")
        if self.mode == "dynamic" and self.predictor is None:
            raise ValueError("--reserve dynamic needs --predictor P.json (`pdserve predictor train`)")

    def hold(self, prompt_ids: tuple[int, ...] | list[int], max_tokens: int) -> OutputHold:
        prediction = None if self.predictor is None else self.predictor.predict(prompt_ids)
        tokens = max_tokens
        if self.mode == "dynamic":
            tokens = min(prediction.upper_tokens, max_tokens)
        return OutputHold(tokens, prediction, tokens >= self.heavy_tokens)


def outcome_bytes(actual_tokens: int, prediction: Prediction, buckets: tuple[int, ...],
                  bytes_per_token: int) -> tuple[str, int, int]:
    """(outcome, under-predicted bytes, over-predicted bytes) of one finished request: `under`
    is the K/V generated past the bucket's upper bound, `over` the reserved K/V never used."""
    outcome = prediction_outcome(actual_tokens, prediction.bucket, buckets)
    _, upper_bytes = reservation_bounds_bytes(prediction.bucket, buckets, bytes_per_token)
    used = actual_tokens * bytes_per_token
    return outcome, max(0, used - upper_bytes), max(0, upper_bytes - used)


def load_policy(mode: str, predictor_path: str | None, model_dir, heavy_tokens: int = 256) -> ReservePolicy:
    """The policy `pdserve serve` runs: the predictor is read and checked against the served
    model's checkpoint and tokenizer identity (raises ValueError with the reason)."""
    from pdserve.model.loader import checkpoint_hash
    from pdserve.model.tokenizer import load_tokenizer
    from pdserve.predictor.manifest import load

    if mode not in MODES:
        raise ValueError(f"--reserve must be one of {MODES}, got {mode!r}")
    predictor = None
    if predictor_path is not None:
        tokenizer = load_tokenizer(model_dir)
        predictor = load(predictor_path, checkpoint_hash(model_dir), tokenizer.identity_hash if tokenizer else None)
    return ReservePolicy(mode, predictor, heavy_tokens)
