"""The CPU tier's `arc` eviction policy: the paper's rules (Megiddo & Modha, FAST 2003), where
vLLM 0.33 departs from them, and the same hits and evictions as vLLM's own CPU tier."""

import random

import pytest

from kvtool.engine.connectors.offloading.arc_policy import ARCPolicy
from kvtool.engine.connectors.offloading.eviction import RequestAccess
from tests.support.peer_server import require_peer_python
from tests.support.offload_replay import make_half, replay_kvtool, replay_vllm, vllm_spec

ANY = lambda key: True  # noqa: E731


def finish(policy, inserted=(), reused=()):
    """One request that stored `inserted` and reused `reused` (both in prefix order) ends."""
    access = RequestAccess()
    for i, key in enumerate([*inserted, *reused]):
        access.saw(key, i, inserted=key in inserted, reused=key in reused)
    policy.request_finished(access)


def store(policy, *keys):
    """A request stores `keys` (evicting what ARC chooses, when full) and ends; returns the victims."""
    policy.note_store_misses(list(keys))
    victims = policy.choose_victims(max(0, len(policy) + len(keys) - policy.capacity), ANY)
    policy.insert(list(keys))
    finish(policy, inserted=keys)
    return victims


def test_a_store_is_one_use_and_a_reuse_makes_a_key_frequent():
    arc = ARCPolicy(4)
    store(arc, b"a")
    assert list(arc.recent) == [b"a"] and not arc.frequent  # the paper's case IV: a miss enters T1
    finish(arc, reused=[b"a"])
    assert not arc.recent and list(arc.frequent) == [b"a"]  # case I: a hit moves it to T2's MRU end
    store(arc, b"b")
    finish(arc, reused=[b"a"])
    assert list(arc.frequent) == [b"a"] and list(arc.recent) == [b"b"]


def test_a_scan_never_evicts_the_frequent_keys():
    """The paper's scan resistance: one-time keys wash through T1 while T2 keeps what is reused."""
    arc = ARCPolicy(4)
    for key in (b"a", b"b"):
        store(arc, key)
        finish(arc, reused=[key])
    victims = [v for key in (b"c", b"d", b"e", b"f", b"g", b"h") for v in store(arc, key)]
    assert victims == [b"c", b"d", b"e", b"f"]  # T1's least recent each time (p = 0)
    assert set(arc.frequent) == {b"a", b"b"} and list(arc.recent) == [b"g", b"h"]
    assert list(arc.recent_ghosts) == victims and arc.target_recent == 0


def test_ghost_hits_adapt_the_target_as_in_the_paper():
    """A miss found in B1 grows p by max(1, |B2|/|B1|) up to c; one in B2 shrinks it by
    max(1, |B1|/|B2|) down to 0 (the paper's cases II and III)."""
    arc = ARCPolicy(4)
    arc.recent_ghosts.update(dict.fromkeys([b"x1", b"x2"]))
    arc.frequent_ghosts.update(dict.fromkeys([b"y1", b"y2", b"y3", b"y4"]))
    arc.note_store_misses([b"x1"])
    assert arc.target_recent == 2.0  # |B2| / |B1| = 4 / 2
    arc.note_store_misses([b"x2"])
    assert arc.target_recent == 4.0  # capped at c
    arc.note_store_misses([b"y1"])
    assert arc.target_recent == 3.0  # max(1, 2 / 4)
    arc.target_recent = 0.5
    arc.note_store_misses([b"y2"])
    assert arc.target_recent == 0.0  # floored at 0
    arc.note_store_misses([b"z"])  # in no ghost list: nothing to learn
    assert arc.target_recent == 0.0
    assert list(arc.recent_ghosts)[-1] == b"x2" and list(arc.frequent_ghosts)[-1] == b"y2"  # moved to MRU


def test_the_victim_comes_from_t2_once_t1_is_below_its_target():
    arc = ARCPolicy(4)
    for key in (b"a", b"b"):
        store(arc, key)
        finish(arc, reused=[key])
    store(arc, b"c")
    store(arc, b"d")
    arc.target_recent = 3.0
    assert arc.choose_victims(1, ANY) == [b"a"]  # |T1| = 2 < p: T2's least recent
    assert list(arc.frequent_ghosts) == [b"a"]
    arc.target_recent = 2.5
    assert arc.choose_victims(1, ANY) == [b"c"]  # |T1| = 2 >= floor(p): T1's (the paper: T2's, as 2 < p)


def test_pinned_keys_are_skipped_and_a_short_supply_is_partial():
    arc = ARCPolicy(3)
    for key in (b"a", b"b", b"c"):
        store(arc, key)
    assert arc.choose_victims(2, lambda k: k != b"a") == [b"b", b"c"]
    assert arc.choose_victims(2, lambda k: False) == []
    assert list(arc.recent) == [b"a"]


def test_where_vllm_departs_from_the_paper():
    """Kept for vLLM's meaning: a key re-stored after a B1 hit enters T1 (the paper: T2), and each
    ghost list holds c keys (the paper: |T1| + |B1| <= c). The third, T1 giving the victim when
    |T1| >= floor(p), is in the test above."""
    arc = ARCPolicy(2)
    store(arc, b"a")
    store(arc, b"b")
    assert store(arc, b"c") == [b"a"]
    assert store(arc, b"a") == [b"b"]  # a B1 hit: p = 1, and |T1| = 2 >= 1 gives T1's LRU
    assert arc.target_recent == 1.0
    assert list(arc.recent) == [b"c", b"a"] and not arc.frequent
    for key in (b"d", b"e", b"f"):
        store(arc, key)
    assert len(arc.recent_ghosts) == arc.capacity  # B1 alone holds c ghosts


def test_reset_forgets_ghosts_and_target():
    arc = ARCPolicy(2)
    for key in (b"a", b"b", b"c", b"a"):
        store(arc, key)
    assert arc.target_recent > 0 and arc.recent_ghosts
    arc.forget_history()
    assert arc.target_recent == 0 and not arc.recent_ghosts and not arc.frequent_ghosts


# A recorded access sequence: requests of one to three chunks over five prefixes, four CPU slots.
# The rows are vLLM 0.33's CPUOffloadingManager on it (recorded once with the peer; the test
# below replays it live): hits, chunks stored, chunks evicted in eviction order.
SEQUENCE = ["c0 c1", "b0 b1 b2", "b0 b1 b2", "b0", "b0", "a0 a1 a2", "b0 b1 b2", "c0", "d0", "e0", "c0", "a0 a1",
            "d0 d1 d2", "d0", "c0 c1", "b0 b1"]
VLLM_ARC = [
    (0, "c0 c1", ""), (0, "b0 b1 b2", "c1"), (3, "", ""), (1, "", ""), (1, "", ""), (0, "a0 a1 a2", "c0 b2 b1"),
    (1, "b1 b2", "a2 a1"), (0, "c0", "a0"), (0, "d0", "b2"), (0, "e0", "b1"), (1, "", ""), (0, "a0 a1", "b0 c0"),
    (1, "d1 d2", "e0 a1"), (1, "", ""), (0, "c0 c1", "a0 d2"), (0, "b0 b1", "d1 c1"),
]
VLLM_LRU_DIFFERS = {11: (0, "a0 a1", "b0 d0"), 12: (0, "d0 d1 d2", "e0 c0 a1"), 15: (0, "b0 b1", "d1 d0")}


def rows(replayed):
    return [(r["hits"], " ".join(r["stored"]), " ".join(r["evicted"])) for r in replayed]


def test_the_recorded_sequence_gives_vllms_hits_and_evictions():
    requests = [s.split() for s in SEQUENCE]
    arc = rows(replay_kvtool(make_half(num_cpu_blocks=4, eviction_policy="arc"), requests))
    lru = rows(replay_kvtool(make_half(num_cpu_blocks=4, eviction_policy="lru"), requests))
    assert arc == VLLM_ARC
    assert lru == [VLLM_LRU_DIFFERS.get(i, row) for i, row in enumerate(VLLM_ARC)]
    # ARC kept d0 through the one-time a0 a1 (d0 had been reused): one more hit than LRU.
    assert sum(r[0] for r in arc) == sum(r[0] for r in lru) + 1


def random_requests(seed: int, n: int = 60) -> list[list[str]]:
    rng = random.Random(seed)
    return [[f"d{doc}.{i}" for i in range(rng.randint(1, 4))] for doc in (rng.randrange(5) for _ in range(n))]


@pytest.mark.peer
def test_same_hits_and_evictions_as_vllms_cpu_tier():
    """Random sequences through vLLM's own CPUOffloadingManager (arc and lru, with and without
    store_threshold, trackers small enough to forget) and through the scheduler half."""
    cases = [(policy, seed, threshold, tracker) for policy in ("arc", "lru") for seed in range(3)
             for threshold, tracker in ((0, 64_000), (2, 64_000), (2, 5), (3, 4))]
    requests = {seed: random_requests(seed) for seed in range(3)}
    requests[0] = [s.split() for s in SEQUENCE]
    specs = [vllm_spec(p, 6 if s else 4, requests[s], t, m) for p, s, t, m in cases]
    theirs = replay_vllm(require_peer_python(), specs)
    for (policy, seed, threshold, tracker), expected in zip(cases, theirs):
        half = make_half(num_cpu_blocks=6 if seed else 4, eviction_policy=policy, store_threshold=threshold,
                         max_tracker_size=tracker)
        assert replay_kvtool(half, requests[seed]) == expected, (policy, seed, threshold, tracker)
