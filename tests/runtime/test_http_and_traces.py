"""The cluster behind real HTTP (the official openai client), and its traces under `trace analyze`."""

from __future__ import annotations

import asyncio
import glob
import os
import subprocess
import sys
from dataclasses import replace

import httpx
import openai
import uvicorn

from pdserve.api.app import create_app
from pdserve.api.server import cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sequence import SamplingParams
from pdserve.ledger.trace import analyze_trace, parse_jsonl
from pdserve.model.cpu import cpu_report
from pdserve.ports import free_local_port
from tests.runtime.conftest import WORKER_THREADS, config, prompt, wait_baseline


LONE_SURROGATES = [  # raw JSON: each escape decodes to an unpaired UTF-16 surrogate, not encodable as UTF-8
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "ok", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "ok", "max_tokens": 2}', "model"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": "\\udc00"}',
     "stop"),
    ("/tokenize", b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
]


def _lone_surrogates(port: int) -> list[tuple[int, dict]]:
    """Each body of `LONE_SURROGATES` as the server answers it: (status, error object)."""
    answers = []
    for path, body, _ in LONE_SURROGATES:
        resp = httpx.post(f"http://127.0.0.1:{port}{path}", content=body, timeout=30,
                          headers={"content-type": "application/json"})
        answers.append((resp.status_code, resp.json().get("error")))
    return answers


def _client_calls(port: int) -> dict:
    surrogates = _lone_surrogates(port)  # first: the calls below show the server kept serving
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    ids = list(prompt(300, 4))  # long enough for layer-wise streaming
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0.0, extra_body=extra)
    streamed = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0.0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(streamed)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=8, extra_body={"ignore_eos": True})
    workers = httpx.get(f"http://127.0.0.1:{port}/workers").json()
    return {"ids": ids, "plain": plain, "chunks": chunks, "chat": chat, "workers": workers, "surrogates": surrogates}


def test_openai_client_against_the_disaggregated_cluster_and_trace_contract(tmp_path):
    trace_dir = str(tmp_path)

    async def main():
        port = free_local_port()
        async with cluster(replace(config(trace_dir=trace_dir), port=port)) as (backend, _):
            server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning"))
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.05)
            result = await asyncio.get_running_loop().run_in_executor(None, _client_calls, port)
            await wait_baseline(backend)
            server.should_exit = True
            await task
            return result

    r = asyncio.run(main())
    local = Engine(EngineConfig(model="tiny", num_blocks=128, num_threads=WORKER_THREADS))
    expected = local.generate([r["ids"]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    plain = r["plain"]
    cpus = [w["cpu"] for w in r["workers"]]  # every worker says what CPU and product plan it computes with
    assert len(cpus) == 2 and all(c["kind"] == cpu_report()["kind"] and c["products"] for c in cpus)
    assert plain.choices[0].token_ids == list(expected.output_ids)
    assert plain.usage.prompt_tokens == 300 and plain.usage.completion_tokens == 12
    streamed_ids = [t for c in r["chunks"] for ch in c.choices for t in (ch.token_ids or [])]
    assert streamed_ids == list(expected.output_ids)
    assert "".join(ch.text for c in r["chunks"] for ch in c.choices) == plain.choices[0].text
    assert r["chunks"][-1].usage.completion_tokens == 12
    assert r["chat"].choices[0].message.role == "assistant" and r["chat"].usage.completion_tokens == 8
    # a lone surrogate in any string field is the field's 400, before a tokenizer or a wire message meets it
    for (path, _, param), (status, error) in zip(LONE_SURROGATES, r["surrogates"], strict=True):
        assert status == 400 and error["param"] == param, (path, param, status, error)
        assert error["type"] == "invalid_request_error" and "lone UTF-16 surrogate" in error["message"], error

    # every transaction in the workers' real traces obeys the transfer-trace contract
    lines = [line for path in sorted(glob.glob(os.path.join(trace_dir, "*-0.jsonl"))) for line in open(path)]
    reports = analyze_trace(parse_jsonl(lines))
    assert reports and all(rep.status == "published" for rep in reports), [(r.transfer, r.status, r.reason) for r in reports]
    layered = [rep for rep in reports if rep.layers_visible]
    assert layered and all(len(rep.layers_visible) == 8 for rep in layered)
    # and the CLI reads the same files
    merged = tmp_path / "merged.jsonl"
    merged.write_text("".join(lines))
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "trace", "analyze", str(merged), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    requests = [line for line in open(os.path.join(trace_dir, "requests.jsonl"))]
    assert len(requests) == 3 and all('"ttft_s"' in line for line in requests)
