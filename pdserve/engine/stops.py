"""Finish conditions and output text: EOS, stop token ids, stop strings, a scripted EOS
(benchmarks), max_tokens, context end.

Contract: `update(seq, token)` is called once per sampled token, after it was appended to
`seq.output_ids`; it returns the newly completed text and a finish reason or None. Stop strings
are matched on the detokenized output; the text is cut before the stop string (the token ids
keep every sampled token). A stop token (EOS unless ignore_eos, or one of stop_token_ids) that
ends the sequence never appears in the text, as vLLM's (without include_stop_str_in_output).
min_tokens (vLLM's): no stop token, scripted EOS or stop string ends a sequence before it has
min_tokens output tokens, and a stop string must end in text past the first min_tokens tokens'.
"""

from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}  # each sequence's stop_token_ids, a set built once

    def start(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self._detok[seq.request_id] = self.tokenizer.detokenizer()
        if seq.params.stop_token_ids:  # a request may list every id of the vocabulary: not scanned per step
            self._stop_ids[seq.request_id] = frozenset(seq.params.stop_token_ids)

    def forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._stop_ids.pop(request_id, None)

    def _is_stop_id(self, seq: Sequence, token: int) -> bool:
        ids = self._stop_ids.get(seq.request_id)
        return token in ids if ids is not None else token in seq.params.stop_token_ids

    def skip_first(self, seq: Sequence, token: int) -> None:
        """Prime the detokenizer with a token sampled elsewhere (the prefill worker)."""
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            seq.text += detok.push(token)
            seq.num_released_chars = len(seq.text)
            self._note_min_tokens_text(seq, len(detok.ids))

    def update(self, seq: Sequence, token: int) -> tuple[str, str | None]:
        """-> (text released by this token, finish reason or None)."""
        params, num_output = seq.params, len(seq.output_ids)
        may_stop = num_output >= params.min_tokens  # vLLM's check_stop: nothing stops before min_tokens
        is_stop_token = may_stop and ((token in self.eos_ids and not params.ignore_eos) or self._is_stop_id(seq, token))
        if not is_stop_token:
            self._push_text(seq, token)
            self._note_min_tokens_text(seq, num_output)
        reason = None
        if is_stop_token:
            reason = "stop"
        elif params.stop and num_output > params.min_tokens and self._cut_at_stop(seq):
            reason = "stop"
        elif params.scripted_eos_tokens is not None and may_stop and num_output >= params.scripted_eos_tokens:
            reason = "stop"  # the benchmark's stand-in for an EOS at the trace's length (sequence.py)
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None and not (params.stop and seq.text_cut):
            self._flush_detokenizer(seq)  # bytes held back for an incomplete character end the text
        return self._release(seq, final=reason is not None), reason

    @staticmethod
    def _note_min_tokens_text(seq: Sequence, num_output: int) -> None:
        """While the output has at most min_tokens tokens, no stop string may end in its text."""
        if num_output <= seq.params.min_tokens:
            seq.stop_search_from = len(seq.text)

    def _flush_detokenizer(self, seq: Sequence) -> None:
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            seq.text += detok.flush()

    def flush(self, seq: Sequence) -> str:
        """Release held-back text now (the sequence leaves this engine mid-request)."""
        return self._release(seq, final=True)

    def _push_text(self, seq: Sequence, token: int) -> None:
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            seq.text += detok.push(token)

    def _release(self, seq: Sequence, final: bool) -> str:
        """Text not yet released; while running, hold back what could start a stop string."""
        hold = 0 if final or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
        end = max(seq.num_released_chars, len(seq.text) - hold)
        piece = seq.text[seq.num_released_chars : end]
        seq.num_released_chars = end
        return piece

    def _cut_at_stop(self, seq: Sequence) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.num_released_chars - longest)
        hits = [i for i in (seq.text.find(s, max(start, seq.stop_search_from - len(s) + 1)) for s in seq.params.stop)
                if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        seq.text_cut = True
        return True
