"""vLLM's min_tokens and repetition_penalty in the engine: the logits processors against a plain
loop, min_tokens against the raw logits' runner-up, and the stop checker's min_tokens and
stop-token text rules (engine/logits_processors.py, engine/stops.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdserve.engine import logits_processors
from pdserve.engine.errors import InvalidRequest
from pdserve.engine.sequence import SamplingParams, Sequence
from pdserve.engine.stops import StopChecker

EOS = frozenset({3})


def reference(row: list[float], seq: Sequence, eos_ids: frozenset[int]) -> list[float]:
    """One row by hand: stop ids at -inf before min_tokens, then vLLM's penalty on seen ids."""
    p, out = seq.params, list(row)
    if len(seq.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            out[t] = -math.inf
    if p.repetition_penalty != 1.0:
        for t in set(seq.prompt_ids) | set(seq.output_ids):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    return out


def test_processors_equal_a_plain_loop():
    rng = random.Random(0)
    for trial in range(60):
        vocab, seqs = 32, []
        for r in range(rng.randrange(1, 5)):
            params = SamplingParams(max_tokens=20, min_tokens=rng.choice([0, 2, 5]), ignore_eos=rng.random() < 0.3,
                                    stop_token_ids=tuple(rng.sample(range(vocab), rng.randrange(0, 3))),
                                    repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]))
            seq = Sequence(f"s{r}", tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, 9))), params, 0)
            seq.output_ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 7))]
            seqs.append(seq)
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(trial))  # [R, V]
        before = logits.clone()
        got = logits_processors.process(logits, seqs, EOS)
        assert torch.equal(logits, before)  # the raw logits (logprobs read them) stay as they were
        for r, seq in enumerate(seqs):
            assert got[r].tolist() == pytest.approx(reference(logits[r].tolist(), seq, EOS)), trial


def test_no_processing_returns_the_same_tensor():
    seq = Sequence("s", (1, 2), SamplingParams(min_tokens=1), 0, output_ids=[5])
    logits = torch.zeros(1, 8)
    assert logits_processors.process(logits, [seq], EOS) is logits


def steps(eng, prompt, params) -> tuple[list[int], list]:
    """Run one request; -> (its output ids, each token's TokenLogprobs)."""
    eng.add_request("r", prompt, params)
    lps = []
    while eng.has_unfinished():
        for out in eng.step():
            lps += out.logprobs
            ids = list(out.output_ids)
    return ids, lps


def test_min_tokens_samples_the_runner_up_where_a_stop_id_won(gqa_ckpt, engine_factory):
    eng = engine_factory(gqa_ckpt)
    prompt = list(range(5, 30))
    full, lps = steps(eng, prompt, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
    k = next(k for k in range(2, 12) if full[k] not in full[:k])
    stop = full[k]
    cut, _ = steps(eng, prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)))
    assert cut == full[: k + 1]  # the first occurrence ends it
    held, _ = steps(eng, prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,),
                                                  min_tokens=k + 1))
    assert held[:k] == full[:k] and held[k] == lps[k].top_ids[1]  # greedy among the others: the runner-up
    assert stop not in held[: k + 1]


@pytest.mark.parametrize("bad", [dict(min_tokens=-1), dict(min_tokens=17), dict(repetition_penalty=0.0),
                                 dict(repetition_penalty=math.inf), dict(stop_token_ids=(-2,))])
def test_params_are_checked(bad):
    with pytest.raises(InvalidRequest, match=next(iter(bad))):
        SamplingParams(max_tokens=16, **bad).validate()


class CharDetok:
    """Token id -> chr(id): a detokenizer for the stop checker's text rules."""

    def __init__(self):
        self.ids = []

    def push(self, token: int) -> str:
        self.ids.append(token)
        return chr(token)

    def flush(self) -> str:
        return ""


class CharTokenizer:
    def detokenizer(self) -> CharDetok:
        return CharDetok()


def run_stops(params: SamplingParams, text: str, first_elsewhere: bool = False) -> tuple[str, str | None, int]:
    """Feed `text` char by char (the first char primed as a handed-off first token when asked);
    -> (output text, finish reason, tokens consumed)."""
    checker, seq = StopChecker(CharTokenizer(), EOS, 1000), Sequence("s", (1,), params, 0)
    checker.start(seq)
    reason = None
    for i, ch in enumerate(text):
        seq.output_ids.append(ord(ch))
        if i == 0 and first_elsewhere:
            checker.skip_first(seq, ord(ch))
            continue
        _, reason = checker.update(seq, ord(ch))
        if reason is not None:
            break
    return seq.text, reason, len(seq.output_ids)


@pytest.mark.parametrize("first_elsewhere", [False, True])
def test_min_tokens_holds_off_stop_strings_and_stop_ids(first_elsewhere):
    words = "is Lee, and I'm a student"
    assert run_stops(SamplingParams(max_tokens=50, stop=("e",)), words, first_elsewhere)[:2] == ("is L", "stop")
    # a stop string must end past the first min_tokens tokens' text ("is Le"): vLLM's rule
    assert run_stops(SamplingParams(max_tokens=50, stop=("e",), min_tokens=5), words, first_elsewhere)[:2] == \
        ("is Le", "stop")
    assert run_stops(SamplingParams(max_tokens=50, stop=("Lee",), min_tokens=5), words, first_elsewhere)[:2] == \
        ("is ", "stop")  # "Lee" ends in the sixth token's text, past "is Le": it stops there
    stop_id = (ord("a"),)
    assert run_stops(SamplingParams(max_tokens=50, stop_token_ids=stop_id), words, first_elsewhere) == \
        ("is Lee, ", "stop", 9)  # the stop id's text is not in the output, its id is
    assert run_stops(SamplingParams(max_tokens=50, stop_token_ids=stop_id, min_tokens=10), words, first_elsewhere) == \
        ("is Lee, and I'm ", "stop", 17)
