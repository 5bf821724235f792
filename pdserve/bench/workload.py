"""Seeded benchmark workloads, independent of HTTP.

Contract: `build_workload(config)` is a pure function of its config (the trace file included):
the same seed gives the same prompts, lengths and unit-rate arrival schedule. Arrival times are
stored at a mean of 1 request/s; `Workload.at_rate(rate)` rescales the time axis only, so every
rate of a sweep replays the same request lengths in the same order. `content_salt` changes only
the prompt content (not lengths, not arrivals): a sweep gives each rate point, and `bench compare`
each round, its own salt, so a server's prefix cache cannot answer a later point from an earlier
one (a trace's verbatim prompts are replayed as they are). `build_workload(config, content=False)`
gives the same requests (lengths, arrivals, conversations) with every generated segment's content
left empty: the simulator reads lengths only, and drawing 200k prompts' ids cost more than
simulating them.

Multi-turn conversations: with `num_conversations = C > 0`, request j is turn j // C of
conversation j % C. Its prompt is the shared prefix, then every earlier turn of that conversation
(user text, then a synthetic assistant reply as long as that turn's output length), then its own
user text; so each turn's prompt extends the previous one. `input_len` sizes each turn's *new*
user text; `shared_prefix_len` tokens of one common system text precede every prompt.

Text prompt lengths assume `PromptStyle.bytes_per_token` and that the server adds
`bos_tokens` (the first segment of a conversation is shortened by that much so the total matches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.bench.arrivals import ArrivalSpec, normalise_trace_times, scale_to_rate, unit_arrivals_s
from pdserve.bench.lengths import LengthSpec, fixed
from pdserve.bench.prompts import PromptStyle, ids_for_tokens, text_for_tokens
from pdserve.bench.trace import TraceEntry, read_trace

Content = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)  # slots: a simulated sweep builds one per request
class Segment:
    """One piece of a prompt: a role (system, user, assistant) and its text or token ids."""

    role: str
    content: Content
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload. `prompt_tokens` is the intended (estimated) prompt length."""

    request_id: int
    arrival_s: float
    segments: tuple[Segment, ...]
    prompt_tokens: int
    output_tokens: int
    conversation_id: int = 0
    turn: int = 0

    @property
    def prompt(self) -> Content:
        """The completions prompt: segments concatenated (a string, or a tuple of ids)."""
        if self.segments and isinstance(self.segments[0].content, tuple):
            return tuple(i for s in self.segments for i in s.content)
        return "".join(s.content for s in self.segments)

    def chat_messages(self) -> list[dict[str, str]]:
        """The chat-completions messages (text prompts only)."""
        if self.segments and isinstance(self.segments[0].content, tuple):
            raise ValueError("chat prompts must be text, not token ids")
        return [{"role": s.role, "content": s.content} for s in self.segments]


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that determines a workload. `num_requests <= 0` with a trace means all lines."""

    num_requests: int
    input_len: LengthSpec = field(default_factory=lambda: fixed(128))
    output_len: LengthSpec = field(default_factory=lambda: fixed(128))
    seed: int = 0
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    prompt_style: PromptStyle = field(default_factory=PromptStyle)
    num_conversations: int = 0
    shared_prefix_len: int = 0
    trace_path: str | None = None
    content_salt: int = 0  # > 0: other prompt content, same lengths and arrivals (see module doc)


@dataclass(frozen=True)
class Workload:
    """Requests on a unit-rate time axis, plus the rate a trace was recorded at (if any)."""

    requests: tuple[BenchRequest, ...]
    native_rate: float | None = None

    def at_rate(self, rate: float | None) -> tuple[BenchRequest, ...]:
        """The requests with arrivals for `rate` req/s (None: the trace's own rate)."""
        rate = self.native_rate if rate is None else rate
        if rate is None:
            raise ValueError("a rate is needed: this workload has no recorded arrival times")
        unit = np.array([r.arrival_s for r in self.requests])
        times = scale_to_rate(unit, rate)
        return tuple(replace(r, arrival_s=float(t)) for r, t in zip(self.requests, times))


def build_workload(config: WorkloadConfig, content: bool = True) -> Workload:
    """The seeded workload `config` describes (without generated content when `content` is False)."""
    seeds = np.random.SeedSequence(config.seed).spawn(4)
    if config.content_salt:  # fresh content; lengths and arrivals keep their own streams
        seeds[3] = np.random.SeedSequence([config.seed, config.content_salt])
    in_rng, out_rng, arrival_rng, content_rng = (np.random.default_rng(s) for s in seeds)
    entries = _trace_entries(config)
    n = len(entries) if entries is not None else config.num_requests
    if n <= 0:
        raise ValueError("num_requests must be > 0")
    out_lens = _output_lens(config, entries, out_rng, n)
    unit_times, native_rate = _arrivals(config, entries, arrival_rng, n)
    user_parts = _user_parts(config, entries, in_rng, content_rng, n)
    requests = _assemble(config, user_parts, out_lens, unit_times, content_rng if content else None)
    return Workload(requests=requests, native_rate=native_rate)


def _trace_entries(config: WorkloadConfig) -> list[TraceEntry] | None:
    if config.trace_path is None:
        return None
    entries = read_trace(config.trace_path)
    return entries[: config.num_requests] if config.num_requests > 0 else entries


def _output_lens(config, entries, rng, n: int) -> np.ndarray:
    if entries is not None:
        return np.array([e.output_len for e in entries], dtype=np.int64)
    return config.output_len.sample(rng, n)


def _arrivals(config, entries, rng, n: int) -> tuple[np.ndarray, float | None]:
    if config.arrival.kind != "trace":
        return unit_arrivals_s(config.arrival, rng, n), None
    if entries is None or any(e.arrival_s is None for e in entries):
        raise ValueError("trace arrivals need a trace whose every line has 'arrival_s'")
    unit, native_rate = normalise_trace_times(np.array([e.arrival_s for e in entries]))
    order = np.argsort([e.arrival_s for e in entries], kind="stable")
    placed = np.empty(n)
    placed[order] = unit
    return placed, native_rate


def _user_parts(config, entries, len_rng, content_rng, n: int) -> list[tuple[Content | None, int]]:
    """Per request (verbatim prompt or None, user-token count)."""
    if entries is None:
        return [(None, int(k)) for k in config.input_len.sample(len_rng, n)]
    return [_entry_part(e, config.prompt_style) for e in entries]


def _entry_part(entry: TraceEntry, style: PromptStyle) -> tuple[Content | None, int]:
    if entry.prompt is None:
        return None, int(entry.prompt_len)
    if style.format == "ids":
        raise ValueError("trace prompts are text; use the text prompt format")
    num_bytes = len(entry.prompt.encode())
    return entry.prompt, max(1, math.ceil(num_bytes / style.bytes_per_token)) + style.implicit_tokens


def _assemble(config, user_parts, out_lens, unit_times, rng) -> tuple[BenchRequest, ...]:
    style = config.prompt_style
    prefix = ()
    if config.shared_prefix_len > 0:
        prefix = (_segment(rng, "system", config.shared_prefix_len, style, first=True),)
    histories: dict[int, tuple[Segment, ...]] = {}
    requests = []
    times = np.asarray(unit_times, dtype=float).tolist()  # Python numbers: no numpy scalar per request
    for j, ((verbatim, user_len), out_len) in enumerate(zip(user_parts, np.asarray(out_lens).tolist())):
        conv, turn = _position(j, config.num_conversations)
        head = prefix + histories.get(conv, ())
        user = _user_segment(rng, verbatim, user_len, style, first=not head)
        segments = head + (user,)
        prompt_tokens = sum(s.num_tokens for s in segments) if head else user.num_tokens
        requests.append(BenchRequest(j, times[j], segments, prompt_tokens, out_len, conv, turn))
        if config.num_conversations > 0:
            reply = _segment(rng, "assistant", int(out_len), style, first=False)
            histories[conv] = segments[len(prefix) :] + (reply,)
    return tuple(requests)


def _position(j: int, num_conversations: int) -> tuple[int, int]:
    """(conversation id, turn) of request j."""
    if num_conversations <= 0:
        return j, 0
    return j % num_conversations, j // num_conversations


def _user_segment(rng, verbatim, num_tokens: int, style: PromptStyle, first: bool) -> Segment:
    if verbatim is not None:
        return Segment("user", verbatim, num_tokens)
    return _segment(rng, "user", num_tokens, style, first)


def _segment(rng, role: str, num_tokens: int, style: PromptStyle, first: bool) -> Segment:
    """`num_tokens` of content (none drawn when `rng` is None); a conversation's first segment
    leaves room for implicit tokens."""
    body = max(1, num_tokens - style.implicit_tokens) if first else num_tokens
    counted = body + style.implicit_tokens if first else body
    if rng is None:
        return Segment(role, () if style.format == "ids" else "", counted)
    if style.format == "ids":
        return Segment(role, ids_for_tokens(rng, body, style), counted)
    return Segment(role, text_for_tokens(rng, body, style), counted)
