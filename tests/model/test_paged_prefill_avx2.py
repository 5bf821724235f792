"""The prefill kernel's AVX2 build (x86-64-v3: its own passes, blocked for 16 ymm registers) keeps the
kernel's whole contract, checked on whatever x86 machine runs the suite: test_paged_prefill's tests
run once more with the kernel modules' build switched to x86-64-v3 (they ask
ckernel.default_march() at each call). test_kernel_isa compares the two builds' outputs."""

from __future__ import annotations

import pytest

from pdserve.model import ckernel, paged_prefill
from pdserve.model.cpu import cpu_report
from tests.model.test_paged_prefill import (  # noqa: F401  (collected here, under the AVX2 build)
    test_a_rows_bits_do_not_depend_on_chunking_or_threads, test_a_strided_bf16_query_scores_as_its_fp32_copy,
    test_a_tp_ranks_head_slice_reads_the_strided_pool_bitwise, test_bf16_is_the_fp32_result_over_widened_values_rounded,
    test_matches_fp32_sdpa)

AVX2 = "x86-64-v3"
pytestmark = pytest.mark.skipif(not (cpu_report()["features"].get("avx2") and paged_prefill.available()),
                                reason="needs an x86 CPU with AVX2 and a C compiler")


@pytest.fixture(autouse=True)
def avx2_build(monkeypatch):
    monkeypatch.setattr(ckernel, "default_march", lambda: AVX2)
    assert paged_prefill._library() is paged_prefill._bound(AVX2) is not None
