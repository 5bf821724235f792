"""DistServe's fitted step times as a latency model (`pdserve.latency.distserve_fit`), on a tiny
synthetic checkout: a profiler JSON with round coefficients and a two-row memory table. Every
time is checked against DistServe's formula worked by hand (ms): prefill a + b * N + c * sum(n ** 2)
+ pp ** 2, decode a + b * (visible tokens) + c * B with the small/large fit by batch, and 2 ms +
0.1 us per context token on the first stage of each iteration."""

from __future__ import annotations

import json

import pytest

from pdserve.latency.distserve_fit import DistServeSpec, distserve_family
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.spec import resolve_latency

FIT = {"decoding_large_small_bs_threshold": 4, "prefill": [10.0, 0.1, 1e-3],
       "decoding_smallbs": [5.0, 0.01, 0.5], "decoding_largebs": [3.0, 0.02, 1.0]}
CAPACITY = "model,tp,pp,max_num_tokens\nfacebook/opt-13b,1,1,5000\nfacebook/opt-13b,1,2,12000\nfacebook/opt-66b,1,1,7\n"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    root = tmp_path_factory.mktemp("distserve")
    data = root / "simdistserve" / "estimators" / "profile_data"
    data.mkdir(parents=True)
    (data / "profiler-a100-80g.vllm.json").write_text(json.dumps({"facebook/opt-13b": {"1": FIT}}))
    (data / "max_num_tokens.csv").write_text(CAPACITY)
    return root


@pytest.fixture(scope="module")
def family(checkout):
    return distserve_family(DistServeSpec.parse(f"distserve:vllm:{checkout}"), load_model_spec("opt-13b"))


def ms(seconds: float) -> float:
    return seconds * 1e3


def test_prefill_is_distserves_fit_with_its_pipeline_and_first_stage_terms(family):
    one = family(1, 1)
    # 10 + 0.1 * 100 + 1e-3 * 100 ** 2 + 1 ** 2 + (2 + 1e-4 * 100)
    assert ms(one.prefill_s(100)) == pytest.approx(33.01, abs=1e-9)
    # a batch of two prompts: sum of rows and of squares, one intercept and one overhead
    assert ms(one.prefill_batch_s((100, 50), (0, 0))) == pytest.approx(10 + 15 + 12.5 + 1 + 2.015, abs=1e-9)
    # 50 rows after 50 cached: c * (2 * causal_pairs - n) = 1e-3 * (2 * (2500 + 1275) - 50); overhead on 100 tokens
    assert ms(one.prefill_s(50, 50)) == pytest.approx(10 + 5 + 7.5 + 1 + 2.01, abs=1e-9)
    two = family(1, 2)
    assert ms(two.prefill_s(100)) == pytest.approx(30 + 4 + 2.01, abs=1e-9)  # pp ** 2 = 4
    # the first stage frees after its 2 ms plus half of the rest
    assert ms(two.prefill_stage_s(two.prefill_s(100))) == pytest.approx(2 + 34.01 / 2, abs=1e-9)
    assert one.prefill_stage_s(0.5) == 0.5


def test_decode_picks_the_small_or_large_fit_by_micro_batch(family):
    one = family(1, 1)
    # below the threshold (4): 5 + 0.01 * 200 + 0.5 * 2 + (2 + 1e-4 * (200 - 2))
    assert ms(one.decode_step_s(2, 200)) == pytest.approx(10.0198, abs=1e-9)
    # at the threshold: 3 + 0.02 * 400 + 1.0 * 4 + (2 + 1e-4 * 396)
    assert ms(one.decode_step_s(4, 400)) == pytest.approx(17.0396, abs=1e-9)
    assert one.decode_step_s(0, 0) == 0.0
    # pp 2: a cycle is one micro-batch of 4 through the whole stack plus two first-stage overheads
    assert ms(family(1, 2).decode_step_s(8, 800)) == pytest.approx(3 + 8 + 4 + 2 * 2.0396, abs=1e-9)


def test_a_mixed_step_is_one_fused_iteration(family):
    one = family(1, 1)
    pairs = 100 * 101 // 2
    # prefill fit over 100 chunk rows + 2 decode rows, the chunk's squares, the decode context term
    expected = 10 + 0.1 * 102 + 1e-3 * (2 * pairs - 100) + 1 + (2 + 1e-4 * 300) + 0.01 * 200
    assert ms(one.mixed_step_s(100, pairs, 200, 1.0, 2, 200)) == pytest.approx(expected, abs=1e-9)
    # a prefill-only step of a whole prompt is its prefill
    assert one.mixed_step_s(100, pairs, 200, 1.0, 0, 0) == pytest.approx(one.prefill_s(100), abs=1e-12)
    assert one.mixed_step_s(0, 0, 0, 0.0, 2, 200) == one.decode_step_s(2, 200)


def test_capacity_comes_from_the_memory_table_and_unfitted_shapes_leave_the_search(family):
    assert family(1, 1).kv_capacity_tokens == 5000
    assert family(1, 2).kv_capacity_tokens == 12000
    assert family(1, 4).kv_capacity_tokens == 0  # no row in the table
    unfitted = family(2, 1)  # the JSON has no tp2 fit
    assert unfitted.kv_capacity_tokens == 0
    with pytest.raises(ValueError, match="no fit at tp2"):
        unfitted.decode_step_s(1, 10)
    assert family(1, 1).kv_bytes_per_token == load_model_spec("opt-13b").kv_bytes_per_token
    assert family(1, 2).pipeline_stages == 2


def test_latency_model_flag_resolves_the_family_and_names_what_is_missing(checkout, tmp_path):
    fixed, fam = resolve_latency(f"distserve:vllm:{checkout}", load_model_spec("opt-13b"))
    assert fixed is None and fam(1, 1).to_dict() == {"kind": "distserve", "engine": "vllm", "tp": 1, "pp": 1}
    with pytest.raises(ValueError, match="has no fit for model 'opt-66b' \\(it has: facebook/opt-13b\\)"):
        resolve_latency(f"distserve:vllm:{checkout}", load_model_spec("opt-66b"))
    with pytest.raises(ValueError, match="profiler-a100-80g.distserve.json is missing"):
        resolve_latency(f"distserve:distserve:{checkout}", load_model_spec("opt-13b"))
    with pytest.raises(ValueError, match="no DistServe checkout at"):
        resolve_latency(f"distserve:vllm:{tmp_path / 'absent'}", load_model_spec("opt-13b"))
    with pytest.raises(ValueError, match="engine must be one of"):
        DistServeSpec.parse(f"distserve:sglang:{checkout}")
    with pytest.raises(ValueError, match="expected distserve:ENGINE:CHECKOUT"):
        DistServeSpec.parse("distserve:vllm")


def test_simulate_command_times_a_lone_prompt_with_the_fit(checkout, capsys):
    """`pdserve simulate --latency-model distserve:...`: an idle instance's TTFT is the prefill fit."""
    from pdserve.cli import main

    assert main(["simulate", "--latency-model", f"distserve:vllm:{checkout}", "--model", "opt-13b", "--mode",
                 "colocated", "--input-len", "100", "--output-len", "3", "--rate", "0.01", "--num-requests", "2",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["completed"] == 2
    assert report["mean_ttft_ms"] == pytest.approx(33.01, abs=1e-6)


@pytest.mark.parametrize("profile,table,message", [
    ([FIT], CAPACITY, "expected an object of models, got list"),
    ({"facebook/opt-13b": [FIT]}, CAPACITY, "malformed fit for facebook/opt-13b"),
    ({"facebook/opt-13b": {"1": FIT}}, "model,tp,max_num_tokens\nfacebook/opt-13b,1,5000\n", "malformed memory table \\(KeyError"),
    ({"facebook/opt-13b": {"1": FIT}}, "model,tp,pp,max_num_tokens\nfacebook/opt-13b,1\n", "malformed memory table \\(TypeError"),
    ({"facebook/opt-13b": {"1": FIT}}, "model,tp,pp,max_num_tokens\nfacebook/opt-13b,1,1,\n", "malformed memory table \\(ValueError"),
])
def test_malformed_files_give_a_value_error_naming_the_file(tmp_path, profile, table, message):
    data = tmp_path / "simdistserve" / "estimators" / "profile_data"
    data.mkdir(parents=True)
    (data / "profiler-a100-80g.vllm.json").write_text(json.dumps(profile))
    (data / "max_num_tokens.csv").write_text(table)
    with pytest.raises(ValueError, match=message) as err:
        distserve_family(DistServeSpec.parse(f"distserve:vllm:{tmp_path}"), load_model_spec("opt-13b"))
    assert str(tmp_path) in str(err.value)
