"""Worker -> router token items carry logprobs, prompt logprobs, a sequence index and forks only
when a request uses them: an ordinary token costs no more bytes than before these fields."""

from __future__ import annotations

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.workers import messages as m


def encoded(**fields) -> bytes:
    item = m.TokenItem("cmpl-0123456789abcdef", (1234,), "abc", False, None, 100, 0, **fields)
    return m.encode(m.Tokens("decode-0", 1, (item,)))


def test_unused_fields_are_not_sent_and_used_ones_round_trip():
    plain = encoded()
    for name in (b"logprobs", b"prompt_logprobs", b"index", b"forks", b"prefilled"):
        assert name not in plain
    lp = TokenLogprobs(1234, -1.5, (1234, 7), (-1.5, -2.0))
    rich = encoded(index=2, logprobs=(lp,), prompt_logprobs=(lp, lp), forks=((0, 5), (2, 9)))
    item = m.decode_to_router(rich).items[0]
    assert (item.index, item.logprobs, item.prompt_logprobs, item.forks) == (2, (lp,), (lp, lp), ((0, 5), (2, 9)))
    assert m.decode_to_router(plain).items[0].logprobs == () and len(rich) > len(plain)
    start = m.StartDecode("r", 5, 7, forks=((0, 5), (2, 9)))
    assert m.decode_to_worker(m.encode(start)) == start
