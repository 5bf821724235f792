"""KV-Runahead partition search (router/runahead/runahead_plan.py): the critical-path model on exact
binary fractions, the search's choice, and the per-(model, K, dtype, CPU kind) cache."""

from __future__ import annotations

import json

from pdserve.router.runahead.runahead_plan import (
    ChunkCost,
    LinkCost,
    PartitionCache,
    RunaheadKey,
    chain_finish_s,
    compositions,
    prompt_chunks,
    search_partition,
)

FREE_LINK = LinkCost(0.0, 1.0, 0)
ROWS = ChunkCost(0.0, 1.0)  # one second per row, attention free
PAIRS = ChunkCost(0.0, 1.0, 0.25)  # plus a quarter second per causal pair


def test_chunks_and_compositions():
    assert prompt_chunks(200, 64) == [64, 64, 64, 8]
    assert list(compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]
    assert list(compositions(3, 3)) == [(1, 1, 1)]


def test_two_equal_chunks_pipeline_one_layer_behind():
    # worker 0: one 4-row chunk, 2 s per layer -> layers ready at 2, 4; worker 1 starts layer 0 at 2
    assert chain_finish_s((4, 4), 4, 2, ROWS, FREE_LINK) == 6.0
    assert chain_finish_s((8,), 4, 2, ROWS, FREE_LINK) == 8.0


def test_link_time_delays_each_layer():
    link = LinkCost(0.5, 4.0, 2)  # 0.5 s + 4 rows * 2 B / 4 B/s = 2.5 s per layer
    # layers of the prefix arrive at 4.5 and 6.5; worker 1 takes 2 s per layer -> 6.5, 8.5
    assert chain_finish_s((4, 4), 4, 2, ROWS, link) == 8.5


def test_search_gives_the_later_worker_fewer_rows_when_attention_grows():
    # chunks [4, 4, 4] cost 6.5, 10.5, 14.5 (10, 26, 42 causal pairs)
    assert chain_finish_s((4, 8), 4, 2, PAIRS, FREE_LINK) == 28.25
    assert chain_finish_s((8, 4), 4, 2, PAIRS, FREE_LINK) == 26.25
    plan = search_partition(12, 2, 4, 2, PAIRS, FREE_LINK)
    assert plan.partition == (8, 4) and plan.predicted_s == 26.25 and plan.single_s == 31.5


def test_search_needs_a_chunk_per_worker():
    assert search_partition(8, 3, 4, 2, ROWS, FREE_LINK) is None
    assert search_partition(9, 3, 4, 2, ROWS, FREE_LINK).partition in {(4, 4, 1)}
    assert search_partition(12, 1, 4, 2, ROWS, FREE_LINK) is None


def test_cache_is_keyed_and_persisted(tmp_path):
    key = RunaheadKey("abc123", 2, "float32", "avx512", (1, 1))
    cache = PartitionCache(key, tmp_path, PAIRS, FREE_LINK, 2)
    assert cache.partition(12, 4) == (8, 4)
    assert cache.partition(12, 4) == (8, 4) and cache.num_searches == 1
    assert cache.partition(8, 8) is None  # one chunk: no chain
    stored = json.loads((tmp_path / "runahead" / key.file_name()).read_text())
    assert stored["key"] == {"model_hash": "abc123", "k": 2, "dtype": "float32", "cpu_kind": "avx512", "tps": [1, 1]}
    assert stored["costs"] == [{"overhead_s": 0.0, "s_per_row": 1.0, "s_per_pair": 0.25}] * 2  # one per stage
    assert stored["partitions"] == {"4:12": [8, 4], "8:8": []}
    again = PartitionCache(key, tmp_path, PAIRS, FREE_LINK, 2)  # a later process: no search
    assert again.partition(12, 4) == (8, 4) and again.num_searches == 0
    refit = PartitionCache(key, tmp_path, ROWS, FREE_LINK, 2)  # another cost model: searched again
    assert refit.partition(12, 4) == (4, 8) and refit.num_searches == 1
    other = PartitionCache(RunaheadKey("abc123", 3, "float32", "avx512", (1, 1, 1)), tmp_path, PAIRS, FREE_LINK, 2)
    assert other.partition(12, 4) == (4, 4, 4) and other.num_searches == 1
