"""`pdserve serve --config FILE` (commands/deploy_config.py): a configuration file sets the
deployment, flags the user sets override it, and what this runtime cannot run is refused with
what is missing named."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.api.server import cluster
from pdserve.cli import build_parser
from pdserve.commands import deploy_config
from pdserve.commands.serve import serve_config, with_config_file
from pdserve.workers.process.tp_rank import TpShape


def write(tmp_path, **config) -> str:
    path = tmp_path / "serve.json"
    deploy_config.write(path, config)
    return str(path)


def parse(*argv):
    args = build_parser().parse_args(["serve", *argv])
    args.cli_argv = ["serve", *argv]  # as pdserve.cli.main records it
    return with_config_file(args)


def test_a_typed_flag_wins_even_at_its_default_value(tmp_path):
    """`--prefill 1` or `--policy jsq` typed on the command line beat the file although each is the
    flag's default (a "differs from the default" test took the file's value)."""
    path = write(tmp_path, mode="disaggregated", prefill=2, decode=2, policy="prefix", max_num_batched_tokens=128)
    config = serve_config(parse("--config", path, "--prefill", "1", "--policy", "jsq"))
    assert (config.num_prefill, config.num_decode, config.policy) == (1, 2, "jsq")
    assert config.engine.max_num_batched_tokens == 128


def test_the_file_carries_the_model_and_dtypes(tmp_path):
    path = write(tmp_path, mode="colocated", replicas=1, model="small", dtype="float32", compute_dtype="float32")
    engine = serve_config(parse("--config", path)).engine
    assert (engine.model, engine.dtype, engine.compute_dtype) == ("small", "float32", "float32")
    assert serve_config(parse("--config", path, "--model", "tiny", "--dtype", "bfloat16")).engine.model == "tiny"


def test_a_model_with_no_checkpoint_here_is_refused_unless_model_is_typed(tmp_path):
    path = write(tmp_path, mode="colocated", replicas=2, model="meta-llama/Llama-3.1-70B")
    with pytest.raises(deploy_config.ConfigError, match="Llama-3.1-70B.*no checkpoint here.*give --model"):
        parse("--config", path)
    assert serve_config(parse("--config", path, "--model", "tiny")).engine.model == "tiny"


def test_the_file_sets_the_deployment_and_set_flags_override_it(tmp_path):
    path = write(tmp_path, mode="disaggregated", prefill=2, decode=1, max_num_batched_tokens=128, policy="jsq",
                 max_num_seqs=16, pd_decision="always")
    args = parse("--config", path, "--policy", "prefix", "--max-num-seqs", "8")
    config = serve_config(args)
    assert (config.mode, config.num_prefill, config.num_decode, config.policy, config.pd_decision) == (
        "disaggregated", 2, 1, "prefix", "always")
    assert config.engine.max_num_batched_tokens == 128 and config.engine.max_num_seqs == 8


@pytest.mark.parametrize("key, value, named", [("prefill_tp", 0, "prefill_tp 0 \\(a tensor-parallel size"),
                                               ("decode_pp", 4, "decode_pp 4"),
                                               ("prefill_runahead", 2, "prefill_runahead 2 \\(a KV-Runahead chain needs 2")])
def test_what_the_runtime_lacks_is_refused_by_name(tmp_path, key, value, named):
    path = write(tmp_path, mode="disaggregated", prefill=1, decode=1, **{key: value})
    with pytest.raises(deploy_config.ConfigError, match=named):
        parse("--config", path)


def test_tensor_parallel_sizes_become_the_workers_tp(tmp_path):
    path = write(tmp_path, mode="disaggregated", prefill=1, decode=1, prefill_tp=2, decode_tp=1, prefill_pp=1)
    assert serve_config(parse("--config", path)).tp == TpShape(prefill=2, decode=1, other=1)
    assert serve_config(parse("--config", path, "--decode-tp", "2")).tp == TpShape(prefill=2, decode=2, other=1)
    colocated = write(tmp_path, mode="colocated", replicas=1, tp=2, pp=1)
    assert serve_config(parse("--config", colocated)).tp == TpShape(prefill=2, decode=2, other=2)


def test_reserve_dynamic_is_accepted_and_needs_a_predictor(tmp_path):
    path = write(tmp_path, mode="disaggregated", prefill=1, decode=1, reserve="dynamic", predictor="p.json",
                 decode_choice="p2c")
    config = serve_config(parse("--config", path))
    assert (config.reserve, config.predictor, config.decode_choice) == ("dynamic", "p.json", "p2c")
    bare = write(tmp_path, mode="disaggregated", prefill=1, decode=1, reserve="dynamic")
    with pytest.raises(ValueError, match="needs --predictor"):
        serve_config(parse("--config", bare))


def test_a_runahead_chain_the_prefill_pool_covers_is_served(tmp_path):
    path = write(tmp_path, mode="disaggregated", prefill=3, decode=1, prefill_runahead=2)
    config = serve_config(parse("--config", path))
    assert (config.num_prefill, config.prefill_runahead) == (3, 2)
    assert serve_config(parse("--config", path, "--prefill-runahead", "3")).prefill_runahead == 3  # the flag wins


def test_a_splitwise_file_carries_a_mixed_pool(tmp_path):
    path = write(tmp_path, mode="splitwise", prefill=1, decode=0, mixed=1)
    config = serve_config(parse("--config", path))
    assert [r.value for r in config.shape().roles()] == ["prefill", "mixed"]
    assert serve_config(parse("--config", path, "--mixed", "2")).num_mixed == 2  # the flag wins
    with pytest.raises(ValueError, match="--mixed 1 goes with --mode splitwise"):
        serve_config(parse("--config", write(tmp_path, mode="disaggregated", prefill=1, decode=1, mixed=1)))


def test_a_file_that_is_not_a_serve_configuration_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mode": "colocated"}))
    with pytest.raises(deploy_config.ConfigError, match="not a pdserve serve configuration"):
        parse("--config", str(bad))
    bad.write_text(json.dumps({"pdserve_serve_config": 1, "gpus": 8}))
    with pytest.raises(deploy_config.ConfigError, match="unknown keys"):
        parse("--config", str(bad))
    with pytest.raises(deploy_config.ConfigError):
        parse("--config", str(tmp_path / "missing.json"))


def test_a_served_configuration_matches_the_file(tmp_path):
    path = write(tmp_path, mode="disaggregated", prefill=2, decode=1, max_num_batched_tokens=128, pd_decision="always")

    async def served():
        config = serve_config(parse("--config", path, "--kv-cache-mb", "32"))
        async with cluster(config) as (backend, _):
            return sorted((w.role, w.state) for w in backend.workers())

    assert asyncio.run(served()) == [("decode", "live"), ("prefill", "live"), ("prefill", "live")]


# a tiny-model fit of this shape (`pdserve profile --quick --model tiny`), fixed so the plan is too
TINY_PROFILE = {"kind": "profiled", "prefill_coef": [0.0077, 2.7e-4, 0.0], "decode_coef": [0.009, 1.65e-4, 1.4e-7]}


@pytest.mark.parametrize("tpot_ms, mode, roles", [(50, "colocated", [("colocated", "live")] * 2),
                                                   (20, "disaggregated", [("decode", "live"), ("prefill", "live")])])
def test_plan_emits_what_serve_runs(tmp_path, capsys, tpot_ms, mode, roles):
    from pdserve.cli import main

    profile, emitted = tmp_path / "tiny.json", tmp_path / "serve.json"
    profile.write_text(json.dumps(TINY_PROFILE))
    assert main(["plan", "--model", "tiny", "--latency-model", str(profile), "--gpus", "2", "--input-dist",
                 "uniform:512,1024", "--output-len", "64", "--slo-ttft-ms", "2000", "--slo-tpot-ms", str(tpot_ms),
                 "--num-requests", "100", "--chunk-budgets", "256", "--json", "--quiet",
                 "--emit-config", str(emitted)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    config = json.loads(emitted.read_text())
    assert config["mode"] == mode and config["source"]["decision"] == summary["decision"].lower()
    assert (config["model"], config["dtype"]) == ("tiny", "bfloat16")  # what the plan was made for
    assert config["max_num_batched_tokens"] == (256 if mode == "colocated" else 512)  # the chunk budget, both modes
    assert not {"policy", "reserve", "prefill_runahead"} & set(config)  # not decided, so not written ...
    assert {"policy", "reserve", "prefill_runahead"} <= set(config["source"]["undecided"])  # ... but named

    async def served():
        args = parse("--config", str(emitted), "--kv-cache-mb", "32", "--pd-profile", "none")
        async with cluster(serve_config(args)) as (backend, _):
            return sorted((w.role, w.state) for w in backend.workers())

    assert asyncio.run(served()) == roles
