"""How the CPU tier's copies are planned (pure functions; run on every machine)."""

from kvtool.engine.connectors.offloading.copy.transfers import coalesce, layer_groups, source_chunks, staging_fills


def test_layer_groups_cover_every_layer_once_in_order():
    assert layer_groups(36, 3) == [(i, i + 3) for i in range(0, 36, 3)]
    assert layer_groups(28, 3)[-1] == (27, 28)  # the last group is shorter
    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(3, 1) == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(3, 7) == [(0, 3)]  # at most every layer in one group
    assert layer_groups(3, 0) == [(0, 1), (1, 2), (2, 3)]  # at least one layer a group
    for n in range(1, 40):
        for per in range(1, 12):
            groups = layer_groups(n, per)
            assert [l for a, b in groups for l in range(a, b)] == list(range(n))
            assert all(b - a == per for a, b in groups[:-1]) and 0 < groups[-1][1] - groups[-1][0] <= per


def test_coalesce_merges_runs_consecutive_on_both_sides():
    pairs = [(10, 3), (11, 4), (12, 5), (13, 9), (20, 10), (21, 11)]
    assert coalesce(pairs) == [(10, 3, 3), (13, 9, 1), (20, 10, 2)]
    assert coalesce([]) == []


def test_source_chunks_follow_consecutive_sources_up_to_a_size():
    pairs = [(0, 7), (1, 2), (2, 40), (3, 1), (9, 5), (10, 6)]
    assert source_chunks(pairs, max_blocks=3) == [(0, 0, 3), (3, 3, 1), (4, 9, 2)]
    assert source_chunks(pairs, max_blocks=100) == [(0, 0, 4), (4, 9, 2)]


def test_staging_fills_pack_source_runs_up_to_the_capacity():
    pairs = [(0, 7), (1, 2), (2, 40), (3, 1), (9, 5), (10, 6), (30, 8)]
    # runs 0-3, 9-10, 30; fills of 3: [0,1,2] [3 | 9,10] [30]
    assert staging_fills(pairs, 3) == [
        (0, 3, [(0, 0, 3)]), (3, 3, [(3, 0, 1), (9, 1, 2)]), (6, 1, [(30, 0, 1)]),
    ]
    assert staging_fills(pairs, 100) == [(0, 7, [(0, 0, 4), (9, 4, 2), (30, 6, 1)])]
    # every pair once, in order, each fill within the capacity
    for cap in (1, 2, 4, 5):
        fills = staging_fills(pairs, cap)
        assert [p for at, n, _ in fills for p in pairs[at : at + n]] == pairs
        assert all(n <= cap and sum(c for _, _, c in pieces) == n for _, n, pieces in fills)
        for at, n, pieces in fills:
            srcs = [s + i for s, _, c in pieces for i in range(c)]
            assert srcs == [src for src, _ in pairs[at : at + n]]
            assert [k for _, k, _ in pieces] == [sum(c for _, _, c in pieces[:j]) for j in range(len(pieces))]
    assert staging_fills([], 4) == []
