"""bench-engine's vLLM peer runs as a subprocess fed pdserve's prompts; its figures become ratios,
and a peer that fails is reported as an error instead of a number."""

from __future__ import annotations

import json
import stat

from pdserve.cli import build_parser
from pdserve.engine import vllm_peer
from pdserve.engine.benchmark import BenchSpec, _prompts, ratios, vllm_tok_s


def _fake_python(tmp_path, body: str):
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_vllm_peer_gets_the_same_prompts_and_its_figures_become_ratios(tmp_path):
    # the fake interpreter saves the prompt file it is given and answers with fixed figures
    seen = tmp_path / "seen.json"
    python = _fake_python(tmp_path, f'''while [ "$1" != "--prompts" ]; do shift; done; cp "$2" {seen}
echo "log line"; echo '{{"prefill_tok_s": 200.0, "decode_tok_s": {{"1": 10.0, "4": 40.0}}}}'\n''')
    spec = BenchSpec(prompt_len=16, batches=(1, 4), repeats=2, vllm_python=python)
    got = vllm_tok_s("/ckpt", spec, vocab=64, threads=2)
    assert got == {"prefill_tok_s": 200.0, "decode_tok_s": {"1": 10.0, "4": 40.0}}
    prompts = json.loads(seen.read_text())
    assert prompts["prefill"] == _prompts(3, 16, 64, 1)  # what pdserve_prefill_tok_s feeds pdserve
    assert prompts["decode"] == {"1": _prompts(1, 16, 64, 3), "4": _prompts(4, 16, 64, 6)}
    ours = {"prefill_tok_s": 100.0, "decode_tok_s": {"1": 5.0, "4": 60.0}}
    assert ratios(ours, got, spec.batches) == {"prefill": 0.5, "decode_1": 0.5, "decode_4": 1.5}


def test_a_failing_vllm_is_an_error_not_a_figure(tmp_path):
    python = _fake_python(tmp_path, 'echo "ImportError: no vllm here" >&2; exit 3\n')
    spec = BenchSpec(prompt_len=8, batches=(1,), repeats=1, vllm_python=python)
    got = vllm_tok_s("/ckpt", spec, vocab=64, threads=1)
    assert got == {"error": "exit 3: ImportError: no vllm here"}
    assert ratios({"prefill_tok_s": 1.0, "decode_tok_s": {"1": 1.0}}, got, spec.batches) == {}
    missing = vllm_tok_s("/ckpt", BenchSpec(vllm_python=str(tmp_path / "nope")), vocab=64, threads=1)
    assert missing["error"].startswith("FileNotFoundError")


def test_cli_flag_and_peer_script_import_without_vllm():
    args = build_parser().parse_args(["bench-engine", "--vllm-python", "/venv/bin/python", "--batches", "1,32"])
    assert args.vllm_python == "/venv/bin/python" and args.batches == "1,32"
    assert callable(vllm_peer.main)  # the script imports vLLM only when it runs


class _FakeArm:
    """Records every call in a shared log; prefill takes `unit` s, a decode call `unit` s per step."""

    def __init__(self, name: str, unit: float, log: list):
        self.name, self.unit, self.log = name, unit, log

    def prefill_s(self, prompt):
        self.log.append((self.name, "prefill", len(prompt)))
        return self.unit

    def start_decode(self, prompts):
        self.log.append((self.name, "start", len(prompts)))

    def decode_s(self, steps):
        self.log.append((self.name, "decode", steps))
        return self.unit * steps

    def stop_decode(self):
        self.log.append((self.name, "stop", 0))


def test_arms_are_timed_back_to_back_in_every_repeat():
    from pdserve.engine.benchmark import DECODE_STEPS, interleaved_tok_s

    log: list = []
    arms = [_FakeArm("a", 0.5, log), _FakeArm("b", 0.25, log)]
    got = interleaved_tok_s(arms, BenchSpec(prompt_len=8, batches=(2,), repeats=2), vocab=64)
    assert got == {"a": {"prefill_tok_s": 16.0, "decode_tok_s": {"2": 4.0}},
                   "b": {"prefill_tok_s": 32.0, "decode_tok_s": {"2": 8.0}}}
    names = [name for name, call, _ in log if call in ("prefill", "decode")]
    assert names == ["a", "b"] * 6  # 3 prefills (one warm-up) then 3 decode chunks, alternating
    assert [c for n, c, _ in log if n == "a"] == ["prefill"] * 3 + ["start"] + ["decode"] * 3 + ["stop"]
    assert all(steps == DECODE_STEPS for _, call, steps in log if call == "decode")
