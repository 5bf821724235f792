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


def test_a_tokens_batch_over_the_bound_goes_item_by_item_and_an_item_over_it_alone_fails_its_request():
    lp = TokenLogprobs(1234, -1.5, tuple(range(20)), tuple(-0.5 for _ in range(20)))
    small = [m.TokenItem(f"r{i}", (i,), "x", False, None, 10, 0) for i in range(3)]
    big = m.TokenItem("big", (1,), "y", True, "length", 4000, 0, prompt_logprobs=(lp,) * 4000)
    whole = m.Tokens("decode-0", 1, (small[0], big, small[1], small[2]))
    assert m.bounded(whole) == [m.encode(whole)]  # under the bound: one message, as before
    limit = len(m.encode(m.Tokens("decode-0", 1, (big,)))) - 1  # the big item alone is over it
    bodies = m.bounded(whole, limit)
    decoded = [m.decode_to_router(b) for b in bodies]
    assert [d.items[0].request_id if isinstance(d, m.Tokens) else (d.request_id, d.code) for d in decoded] == \
        ["r0", ("big", "message_too_large"), "r1", "r2"]
    assert all(len(b) <= limit for b in bodies)
