"""How the CPU tier's copies are planned (pure functions; run on every machine)."""

from kvtool.engine.connectors.offloading.transfers import coalesce, source_chunks


def test_coalesce_merges_runs_consecutive_on_both_sides():
    pairs = [(10, 3), (11, 4), (12, 5), (13, 9), (20, 10), (21, 11)]
    assert coalesce(pairs) == [(10, 3, 3), (13, 9, 1), (20, 10, 2)]
    assert coalesce([]) == []


def test_source_chunks_follow_consecutive_sources_up_to_a_size():
    pairs = [(0, 7), (1, 2), (2, 40), (3, 1), (9, 5), (10, 6)]
    assert source_chunks(pairs, max_blocks=3) == [(0, 0, 3), (3, 3, 1), (4, 9, 2)]
    assert source_chunks(pairs, max_blocks=100) == [(0, 0, 4), (4, 9, 2)]
