"""What `pdserve simulate` pays before it simulates (issue 40, simulator speed): no prompt content
for the simulator's workload, no torch for the parser."""

from __future__ import annotations

import subprocess
import sys

from pdserve.bench.lengths import parse_length_spec
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.workload import WorkloadConfig, build_workload
from pdserve.sim.requests import SimRequests, build_requests


def test_requests_without_content_are_the_same_requests():
    for style in (PromptStyle(format="ids"), PromptStyle()):
        config = WorkloadConfig(num_requests=300, input_len=parse_length_spec("uniform:8,600"), output_len=parse_length_spec("uniform:2,90"), seed=7,
                                prompt_style=style, num_conversations=20, shared_prefix_len=32)
        bare = build_workload(config, content=False)
        assert all(s.content in ((), "") for r in bare.requests for s in r.segments)
        full = SimRequests.from_workload(build_workload(config), prefix_cache=True, shared_prefix_len=32)
        assert build_requests(config, prefix_cache=True) == full
        assert sum(full.prompt_tokens) > 300 * 8 and len(set(full.cached_tokens)) > 2


def test_the_parser_does_not_import_torch():
    code = ("import sys; from pdserve.cli import build_parser; p = build_parser(); "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "assert {'simulate', 'plan', 'bench-transfer', 'serve'} <= set(p._subparsers._group_actions[0].choices)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_simulate_loads_neither_the_http_client_nor_the_api_schema(tmp_path):
    """The workload flags are read by the benchmark's argument module, whose HTTP client (httpx,
    the API's pydantic schema, FastAPI's errors) loads only with `pdserve bench`: 0.3 s of a
    200,000-request simulation's 3 s."""
    model = tmp_path / "constant.json"
    model.write_text('{"kind": "constant", "prefill_ms": 20, "decode_step_ms": 10}')
    code = ("import sys, io, contextlib; from pdserve.cli import main; "
            f"argv = ['simulate', '--latency-model', {str(model)!r}, '--mode', 'disaggregated', '--rate', '20', "
            "'--num-requests', '50', '--input-len', '256', '--output-len', '16', '--json']; "
            "out = io.StringIO(); contextlib.redirect_stdout(out).__enter__(); assert main(argv) == 0; "
            "loaded = sorted(m for m in ('fastapi', 'pydantic', 'httpx', 'pdserve.bench.http.client', 'pdserve.api.protocol', "
            "'torch') if m in sys.modules); assert not loaded, loaded; assert '\"completed\": 50' in out.getvalue()")
    subprocess.run([sys.executable, "-c", code], check=True)
