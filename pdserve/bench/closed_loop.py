"""Closed-loop multi-turn conversations: each turn's prompt carries the previous turn's real answer.

Contract: `run_closed_loop(endpoint, config)` runs `num_conversations` conversations at once;
within one, turn t + 1 is sent only after turn t's stream ended, and its prompt is turn t's
prompt, then the answer text the server actually streamed for it, then `turn_len` tokens of new
user text (turn 0: `shared_prefix_len` tokens of one system text all conversations share, then
`input_len` tokens of its own). Prompts are text (completions API); their token counts assume
`bytes_per_token` (the built-in models' byte tokenizer: 1). Every request yields one `TurnRecord`
(the client's `RequestRecord`, the conversation, the turn and the answer's characters); a failed
turn ends its conversation (later turns would not carry a real answer). `summarize_turns` gives
TTFT p50 / p90 per turn and over turns >= 1 (the turns a conversation's history can serve).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from pdserve.bench.http.client import (API_PATHS, EndpointConfig, StreamTimer, classify_error,
                                       make_transport_for, request_body, request_headers)
from pdserve.bench.metrics import percentile
from pdserve.bench.prompts import PromptStyle, text_for_tokens
from pdserve.bench.records import RequestRecord
from pdserve.bench.http.sse import parse_sse_line
from pdserve.bench.workload import BenchRequest, Segment


@dataclass(frozen=True)
class ClosedLoopConfig:
    num_conversations: int
    num_turns: int
    input_len: int  # turn 0's own user text (tokens)
    turn_len: int  # each later turn's new user text (tokens)
    output_len: int
    shared_prefix_len: int = 0
    bytes_per_token: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.input_len, self.output_len) < 1 or self.turn_len < 0:
            raise ValueError("closed loop: conversations, turns, input and output lengths must be positive")


@dataclass(frozen=True)
class TurnRecord:
    conversation: int
    turn: int
    record: RequestRecord
    answer_chars: int


async def run_closed_loop(endpoint: EndpointConfig, config: ClosedLoopConfig) -> list[TurnRecord]:
    transport = make_transport_for(endpoint)
    rng = np.random.default_rng(config.seed)
    style = PromptStyle(bytes_per_token=config.bytes_per_token)
    system = text_for_tokens(rng, config.shared_prefix_len, style) if config.shared_prefix_len else ""
    starts = [system + text_for_tokens(rng, config.input_len, style) for _ in range(config.num_conversations)]
    follow_ups = [[text_for_tokens(rng, config.turn_len, style) if config.turn_len else "" for _ in range(config.num_turns)]
                  for _ in range(config.num_conversations)]
    run_start_s = time.perf_counter()
    try:
        runs = [_conversation(transport, endpoint, config, c, starts[c], follow_ups[c], run_start_s)
                for c in range(config.num_conversations)]
        results = await asyncio.gather(*runs)
    finally:
        await transport.aclose()
    return sorted((r for turns in results for r in turns), key=lambda r: (r.conversation, r.turn))


async def _conversation(transport, endpoint, config, conv: int, prompt: str, follow_ups: list[str],
                        run_start_s: float) -> list[TurnRecord]:
    turns = []
    for turn in range(config.num_turns):
        request_id = conv * config.num_turns + turn
        request = BenchRequest(request_id, time.perf_counter() - run_start_s, (Segment("user", prompt, 0),),
                               round(len(prompt.encode()) / config.bytes_per_token), config.output_len, conv, turn)
        record, answer = await _send(transport, request, endpoint, run_start_s)
        turns.append(TurnRecord(conv, turn, record, len(answer)))
        if not record.success:
            break
        prompt = prompt + answer + follow_ups[turn]
    return turns


async def _send(transport, request: BenchRequest, endpoint: EndpointConfig, run_start_s: float) -> tuple[RequestRecord, str]:
    """One streamed turn: its record and the answer text as streamed."""
    timer, text = StreamTimer(time.perf_counter()), []
    headers = request_headers(request, endpoint, f"c{request.conversation_id}t{request.turn}")
    try:
        async with asyncio.timeout(endpoint.request_timeout_s):
            async with transport.post_lines(API_PATHS["completions"], request_body(request, endpoint), headers) as response:
                if response.status != 200:
                    async for _ in response.lines:
                        pass
                    return timer.record(request, run_start_s, f"http:{response.status}"), ""
                async for now_s, line in response.lines:
                    event = parse_sse_line(line) if not timer.done else None
                    if event is not None:
                        timer.add(event, now_s)
                        text.append(event.text)
    except Exception as exc:  # noqa: BLE001 - a failed turn is a record, not a crash
        timer.end_s = time.perf_counter()
        return timer.record(request, run_start_s, classify_error(exc)), ""
    return timer.record(request, run_start_s), "".join(text)


def summarize_turns(turns: list[TurnRecord]) -> dict:
    """TTFT p50 / p90 (seconds) by turn and over turns >= 1, successful turns only."""
    ok = [t for t in turns if t.record.success and t.record.ttft_s is not None]
    by_turn = {}
    for turn in sorted({t.turn for t in ok}):
        ttfts = [t.record.ttft_s for t in ok if t.turn == turn]
        by_turn[turn] = {"n": len(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90)}
    later = [t.record.ttft_s for t in ok if t.turn >= 1]
    return {"turns": by_turn, "later_turns": {"n": len(later), "ttft_p50_s": percentile(later, 50),
                                              "ttft_p90_s": percentile(later, 90)},
            "failed": sum(1 for t in turns if not t.record.success)}
