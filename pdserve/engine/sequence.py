"""Requests inside one engine: sampling parameters, the sequence record and its state machine.

Life cycle of a sequence (illegal transitions raise `IllegalTransition`):

    WAITING --schedule--> RUNNING --finish--> FINISHED
       ^                    |  \\
       +----preempt---------+   +--prefill done (prefill-only)--> PREFILLED --release--> FINISHED
    any non-finished state --abort--> FINISHED (finish_reason "abort")

A sequence's tokens are prompt + outputs; `num_computed` counts the leading tokens whose K/V is
in the pool. A RUNNING sequence with more than one uncomputed token is prefilling (possibly in
chunks); with exactly one it is decoding. Imported sequences (decode from handed-off K/V) start
RUNNING with the prompt already computed and the first token already sampled.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from pdserve.engine.errors import IllegalTransition, InvalidRequest


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
# Stop strings are searched for in every step's new text on the engine thread, each one apart: a
# request with 280,000 of them (a 4 MB body) cost its worker ~110 ms a step, slowing every request
# there. TGI caps them at 4 by default, OpenAI at 4; this leaves room for any real client
MAX_STOP_STRINGS = 128
# and each is searched for over a window of about twice the longest, by a search that is quadratic
# in the worst case: 128 strings of 1,249 characters cost ~120 ms a step. Bounded per string and in all
MAX_STOP_STRING_CHARS, MAX_STOP_CHARS = 256, 4096
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # dividing a logit by less (multiplying by more) leaves fp32's range


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities per output token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (computed in prefill)
    n: int = 1  # independent output sequences over one prompt (engine/fork.py)
    tenant: str = "default"  # whose prefix cache the request reads and fills (block_manager.root_for)
    # benchmarking: finish ("stop") after this many output tokens, as if the model had emitted EOS
    # there (a random-weight model never does; a trace's recorded length stands in). Nothing that
    # routes or reserves reads it: max_tokens stays the request's bound (engine/stops.py)
    scripted_eos_tokens: int | None = None
    # vLLM's: EOS and stop_token_ids are never sampled (nor stop strings matched) before this many
    # output tokens (engine/logits_processors.py, engine/stops.py)
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # vLLM's, over prompt + output tokens; > 1 penalizes repeats

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= _FP32_MAX:
            # above fp32's largest it is inf there, and a logit already at -inf (min_tokens, bias) / inf is NaN
            raise InvalidRequest(f"temperature must be from 0 to {_FP32_MAX:.3g}, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not _is_count(self.min_tokens) or self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens must be from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not math.isfinite(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            # the penalty divides or multiplies fp32 logits: far outside 1 a logit becomes inf and sampling NaN
            raise InvalidRequest(f"repetition_penalty must be a number from {low:g} to {high:g}, "
                                 f"got {self.repetition_penalty!r}")
        if not all(_is_count(t) for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.stop and (max(map(len, self.stop)) > MAX_STOP_STRING_CHARS or sum(map(len, self.stop)) > MAX_STOP_CHARS):
            raise InvalidRequest(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters each and "
                                 f"{MAX_STOP_CHARS} in all, got {max(map(len, self.stop))} and {sum(map(len, self.stop))}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidRequest(f"{name} must be a non-negative integer or None, got {value!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequest(f"n must be a positive integer, got {self.n!r}")
        if self.scripted_eos_tokens is not None and (not isinstance(self.scripted_eos_tokens, int)
                                                     or self.scripted_eos_tokens < 1):
            raise InvalidRequest(f"scripted_eos_tokens must be a positive integer, got {self.scripted_eos_tokens!r}")

    @property
    def greedy(self) -> bool:
        # vLLM's rule (_SAMPLING_EPS): a temperature this small is greedy. Dividing fp32 logits by
        # it would overflow to inf (or, below fp32's range, divide by zero) and sample NaNs
        return self.temperature < GREEDY_BELOW


_FP32_MAX = 3.4028234663852886e38  # fp32's largest finite number


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"
    FINISHED = "finished"


_ALLOWED = {
    SeqStatus.WAITING: {SeqStatus.RUNNING, SeqStatus.FINISHED},
    SeqStatus.RUNNING: {SeqStatus.WAITING, SeqStatus.PREFILLED, SeqStatus.FINISHED},
    SeqStatus.PREFILLED: {SeqStatus.FINISHED},
    SeqStatus.FINISHED: set(),
}


class SeqMode(enum.Enum):
    NORMAL = "normal"  # prefill and decode here (colocated)
    PREFILL_ONLY = "prefill_only"  # stop after the first token; K/V kept for export
    IMPORTED = "imported"  # decode from K/V placed by a handoff


@dataclass
class Sequence:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    mode: SeqMode = SeqMode.NORMAL
    arrival: int = 0  # admission order; larger = newer (preempted first)
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full, registered blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    queued_s: float = 0.0  # when this worker's scheduler took it in (its clock): the age prompt priority reads
    finish_reason: str | None = None
    text: str = ""
    num_released_chars: int = 0  # leading chars of `text` already reported to the caller
    text_cut: bool = False  # a stop string ended the text
    stop_search_from: int = 0  # a stop string must end past this many chars: the first min_tokens outputs' text
    index: int = 0  # which of the request's n output sequences this is (engine/fork.py)
    group: str = ""  # the caller's request id; "" means `request_id` (every sequence of an n = 1 request)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs per prompt token from position 1, as computed

    @property
    def caller_id(self) -> str:
        """The id the caller knows this sequence's request by (a forked sequence has its own
        engine key, `<request id>#n<index>`)."""
        return self.group or self.request_id

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is SeqStatus.RUNNING and self.num_uncomputed == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def transition(self, new: SeqStatus) -> None:
        if new not in _ALLOWED[self.status]:
            raise IllegalTransition(f"sequence {self.request_id}: {self.status.value} -> {new.value} is not allowed")
        self.status = new

    def finish(self, reason: str) -> None:
        self.transition(SeqStatus.FINISHED)
        self.finish_reason = reason
