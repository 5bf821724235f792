"""bench-engine's arms are timed back to back; the vLLM arm is a subprocess speaking vllm_peer's
protocol, fed pdserve's prompts; a vLLM that cannot start is reported as an error, not a number."""

from __future__ import annotations

import json
import stat
import sys

from pdserve.cli import build_parser
from pdserve.engine.speed import vllm_peer
from pdserve.engine.speed.bench_arms import VllmArm
from pdserve.engine.speed.benchmark import BenchSpec, _prompts, arm_order, interleaved_tok_s, ratios


FAKE_PEER = """
import json, sys
from pdserve.engine.speed.vllm_peer import REPLY
args = sys.argv[1:]
open(args[args.index("--record") + 1], "w").write(json.dumps(args))
print("INFO a vLLM log line on stdout")
print(REPLY + json.dumps({"ready": True, "engine": "vllm fake"}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    with open(args[args.index("--record") + 1], "a") as f:
        f.write("\\n" + json.dumps(cmd))
    if cmd["op"] == "quit":
        break
    reply = {"s": 0.5} if cmd["op"] == "prefill" else {"s": 0.25 * cmd["steps"]} if cmd["op"] == "decode" else {"ok": True}
    print(REPLY + json.dumps(reply), flush=True)
"""


def _fake_python(tmp_path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_vllm_arm_speaks_the_peer_protocol_and_is_interleaved(tmp_path):
    (tmp_path / "peer.py").write_text(FAKE_PEER)
    record = tmp_path / "record.txt"
    python = _fake_python(tmp_path, f'exec {sys.executable} {tmp_path / "peer.py"} --record {record} "$@"\n')
    arm = VllmArm(python, "/ckpt", "bfloat16", threads=2, max_model_len=600, max_batch=4, max_steps=25)
    assert arm.engine == "vllm fake"
    got = interleaved_tok_s([arm], BenchSpec(prompt_len=8, batches=(4,), repeats=2, settle_s=0), vocab=64)
    arm.close()
    assert got == {"vllm": {"prefill_tok_s": 16.0, "decode_tok_s": {"4": 16.0}}}
    argv, *cmds = record.read_text().split("\n")
    argv = json.loads(argv)
    assert argv[argv.index("--max-model-len") + 1] == "600" and argv[argv.index("--max-batch") + 1] == "4"
    cmds = [json.loads(c) for c in cmds]
    assert [c["prompt"] for c in cmds if c["op"] == "prefill"] == _prompts(3, 8, 64, 1)  # pdserve's prompts
    start = next(c for c in cmds if c["op"] == "start_decode")
    assert start["prompts"] == _prompts(4, 8, 64, 6) and start["max_steps"] == 25
    assert [c["op"] for c in cmds][-2:] == ["stop_decode", "quit"]


def test_a_vllm_that_cannot_start_is_an_error_not_a_figure(tmp_path):
    from pdserve.engine.speed.benchmark import _start_vllm

    python = _fake_python(tmp_path, 'echo "ImportError: no vllm here" >&2; exit 3\n')
    got = _start_vllm(BenchSpec(prompt_len=8, batches=(1,), repeats=1, vllm_python=python), "/ckpt", 1)
    assert got == {"error": "RuntimeError: vLLM exited (3): ImportError: no vllm here"}
    missing = _start_vllm(BenchSpec(vllm_python=str(tmp_path / "nope")), "/ckpt", 1)
    assert missing["error"].startswith("FileNotFoundError")
    assert _start_vllm(BenchSpec(), "/ckpt", 1) is None
    assert ratios({"prefill_tok_s": 1.0, "decode_tok_s": {"1": 1.0}}, {"error": "x"}, (1,)) == {}
    assert ratios({"prefill_tok_s": 1.0, "decode_tok_s": {"1": 3.0}}, {"prefill_tok_s": 2.0, "decode_tok_s": {"1": 2.0}},
                  (1,)) == {"prefill": 0.5, "decode_1": 1.5}


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


def test_every_arm_follows_every_other_arm_equally_often():
    """A rotation keeps the cyclic order (each arm always after the same one); the design balances it."""
    for n in range(2, 7):
        rows = [arm_order(n, r) for r in range(2 * n if n % 2 else n)]
        assert all(sorted(row) == list(range(n)) for row in rows)
        follows = {}
        for row in rows:
            for before, after in zip(row, row[1:]):
                follows[(before, after)] = follows.get((before, after), 0) + 1
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1, (n, follows)


def test_arms_are_timed_back_to_back_in_every_repeat_in_rotated_order():
    from pdserve.engine.speed.benchmark import DECODE_STEPS

    log: list = []
    arms = [_FakeArm("a", 0.5, log), _FakeArm("b", 0.25, log)]
    got = interleaved_tok_s(arms, BenchSpec(prompt_len=8, batches=(2,), repeats=2, settle_s=0), vocab=64)
    assert got == {"a": {"prefill_tok_s": 16.0, "decode_tok_s": {"2": 4.0}},
                   "b": {"prefill_tok_s": 32.0, "decode_tok_s": {"2": 8.0}}}
    names = [name for name, call, _ in log if call in ("prefill", "decode")]
    assert names == ["a", "b", "b", "a", "a", "b"] * 2  # 3 prefills (one warm-up), 3 decode chunks; rotated
    assert [c for n, c, _ in log if n == "a"] == ["prefill"] * 3 + ["start"] + ["decode"] * 3 + ["stop"]
    assert all(steps == DECODE_STEPS for _, call, steps in log if call == "decode")
