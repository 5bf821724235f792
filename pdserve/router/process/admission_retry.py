"""When a request in admission routes again instead of being refused: the rejections worth
waiting out, and the signals a route that cannot start raises (router/process/frontend.py's admission
loop catches them, releases the route's holds and routes the request again until its deadline).
"""

from __future__ import annotations

ADMISSION_POLL_S = 0.02
WAITABLE = {"no_decode_capacity", "no_transfer_buffer"}  # capacity that completions will free


def admission_waits(reason: str, restarts: bool, away: set[str]) -> bool:
    """A rejection worth waiting out in admission: capacity that completions will free, or no
    complete route only because a worker is dead and the supervisor is starting it again."""
    return reason in WAITABLE or (reason == "no_route" and restarts and bool(away))


class AdmissionRetry(Exception):
    """The route being admitted cannot start; the admission routes the request again after
    `wait_s` (until its deadline). Its holds are released by the admission, not by the raiser."""

    wait_s = ADMISSION_POLL_S

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CapacityShort(AdmissionRetry):
    """A worker had less K/V room than its last report said: wait for completions to free some."""


class RouteLost(AdmissionRetry):
    """A worker on the route was lost (or re-registered) before the request started there: no
    worker owns the request yet, so it is routed again over the live workers at once."""

    wait_s = 0.0
