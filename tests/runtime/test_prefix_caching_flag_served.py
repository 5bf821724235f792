"""`pdserve serve --no-enable-prefix-caching` (vLLM's flag): no prompt reuses K/V, the same prompt
twice included, through the handoff (`--pd-decision always`), and the tokens are the ones an
engine without a prefix cache computes. Before, the prefix cache could not be turned off from the
CLI; the flag is on by default, as vLLM's is."""

from __future__ import annotations

import httpx

from pdserve.cli import build_parser
from pdserve.commands.serve import serve_config
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from tests.api.served_cli import serve_logged, stop, wait_healthy
from tests.runtime.conftest import WORKER_THREADS, prompt


def test_the_flag_defaults_on_and_reaches_the_workers_config():
    parse = build_parser().parse_args
    assert serve_config(parse(["serve", "--model", "tiny"])).engine.enable_prefix_cache is True
    assert serve_config(parse(["serve", "--model", "tiny", "--host-kv-mb", "8"])).engine.host_kv_bytes == 8 << 20
    off = serve_config(parse(["serve", "--model", "tiny", "--no-enable-prefix-caching", "--host-kv-mb", "8"])).engine
    assert off.enable_prefix_cache is False and off.host_kv_bytes == 0  # no cache: no evicted blocks to keep


def test_without_prefix_caching_a_repeated_prompt_reuses_nothing_and_decodes_the_same_tokens(tmp_path):
    ids = list(prompt(80, 3))  # five full blocks a cache would keep
    proc, port = serve_logged(tmp_path / "serve.log", "--no-enable-prefix-caching", "--pd-decision", "always")
    try:
        wait_healthy(port, 180.0)
        answers = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0.0,
                                    "ignore_eos": True, "return_token_ids": True}).json() for _ in range(2)]
    finally:
        stop(proc)
    local = Engine(EngineConfig(model="tiny", num_blocks=64, num_threads=WORKER_THREADS, enable_prefix_cache=False))
    expected = list(local.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_ids)
    for answer in answers:
        assert answer["usage"]["prompt_tokens"] == 80, answer
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer
        assert answer["choices"][0]["token_ids"] == expected
