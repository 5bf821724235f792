"""CPU feature detection: the two kinds this project runs on, read from /proc/cpuinfo text."""

from __future__ import annotations

from pathlib import Path

from pdserve.model.cpu import ISA_CAPS, cpu_report, kind_of, parse_cpuinfo, summary

AMD = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse4_2 avx fma avx2 bmi2\n"
INTEL = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
         "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n")


def _features(text: str) -> dict[str, bool]:
    flags = parse_cpuinfo(text)[1]
    return {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}


def test_both_kinds_are_told_apart():
    assert parse_cpuinfo(AMD)[0] == "AMD EPYC 7B13"
    assert kind_of(_features(AMD)) == "avx2"
    assert parse_cpuinfo(INTEL)[0].startswith("Intel(R) Xeon(R) Platinum")
    assert kind_of(_features(INTEL)) == "avx512-amx"
    no_amx = INTEL.replace(" amx_bf16", "")
    assert kind_of(_features(no_amx)) == "avx512-bf16"
    assert kind_of(_features(no_amx.replace(" avx512_bf16", ""))) == "avx512"
    assert kind_of(_features(AMD), x86=False) == "other"


def test_report_of_this_machine_names_caps(monkeypatch):
    report = cpu_report()
    assert report["kind"] in ("avx2", "avx512", "avx512-bf16", "avx512-amx", "other")
    assert report["torch_capability"] and isinstance(report["mkl"], bool)
    line = summary()
    assert line.startswith(f"cpu={report['kind']} (")
    cpu_report.cache_clear()
    for name in ISA_CAPS:  # the run's own caps (an ISA-capped suite sets them) would be named too
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    try:
        assert cpu_report()["isa_caps"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"} and "MKL_ENABLE_INSTRUCTIONS=AVX2" in summary()
    finally:
        cpu_report.cache_clear()


def test_generate_json_reports_the_cpu_and_product_plan():
    import json
    import subprocess
    import sys

    for dtype, plan in (("bfloat16", None), ("float32", "tiled")):
        out = subprocess.run([str(Path(sys.executable).with_name("pdserve")), "generate", "--prompt-ids", "5,6,7", "--max-tokens", "2",
                              "--ignore-eos", "--dtype", dtype, "--json"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        cpu = json.loads(out.stdout)["cpu"]
        assert cpu["kind"] == cpu_report()["kind"] and cpu["compute_dtype"] == dtype
        assert plan is None or cpu["products"].startswith(plan)
