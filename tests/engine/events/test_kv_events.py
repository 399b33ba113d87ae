"""vLLM's KV events from the engine, decoded by vLLM 0.33's own classes in the peer environment.

The subscriber (`kvtool/peer/kv_events_subscriber.py`, run by the peer interpreter) rebuilds the
cache by applying every event in sequence order; at the end that must be exactly the set of
block hashes in the engine's block pool. It also checks that every payload re-encodes to the
same bytes with vLLM's structs, and that each BlockStored's hashes are vLLM's hashes of its
parent, tokens and extra keys. The replay endpoint serves what a late subscriber missed, from a
buffer of the last `buffer_steps` batches.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtool.engine.params import SamplingParams, parse_kv_events_config
from kvtool.peer.env import peer_env, peer_script
from tests.support.peer_server import require_peer_python

pytestmark = pytest.mark.peer

BLOCK_SIZE = 16


class Subscriber:
    """The peer-side subscriber process: a SUB socket bound on a free loopback port."""

    def __init__(self, topic: str = "") -> None:
        self.proc = subprocess.Popen(
            [str(require_peer_python()), str(peer_script("kv_events_subscriber.py")), "--topic", topic],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=peer_env(),
        )
        self.endpoint = self._answer()["endpoint"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            pytest.fail(f"the subscriber exited ({self.proc.returncode}):\n{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def subscriber():
    sub = Subscriber(topic="kv@tiny")
    yield sub
    sub.stop()


def _events_config(sub: Subscriber, **fields) -> str:
    doc = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sub.endpoint,
           "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv@tiny", **fields}
    return json.dumps(doc)


def _run_workload(engine) -> None:
    """Shared prefixes, more blocks than the pool holds (evictions), a salt, and a reset."""
    shared = [(7 * i) % 500 + 3 for i in range(40)]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for rnd in range(3):
        prompts = [shared + [(rnd * 31 + j * 11 + k) % 500 + 3 for k in range(20 + 9 * j)] for j in range(3)]
        engine.generate(prompts, greedy)
        if rnd == 1:
            engine.reset_prefix_cache()
    engine.generate([shared + [5] * 30], greedy, cache_salts=["tenant-a"])
    engine.generate([shared[:33]], greedy)  # a hit on blocks stored before


def _cached_hashes(engine, as_int: bool) -> list[str]:
    """The pool's cached hashes as the subscriber states them (a group past 0 as 'g<group>:')."""
    out = []
    for key in engine.scheduler.pool.cached:
        h, group = key[:-4], int.from_bytes(key[-4:], "big")
        name = str(int.from_bytes(h, "big") & ((1 << 64) - 1)) if as_int else h.hex()
        out.append(name if group == 0 else f"g{group}:{name}")
    return sorted(out)


OFFLOADING = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"num_cpu_blocks":64}}'


@pytest.mark.parametrize(
    ("as_int", "transfer"),
    [(True, None), (False, None), (True, OFFLOADING)],
    ids=["int-hashes", "bytes-hashes", "int-hashes-with-cpu-offload"],
)
def test_events_rebuild_the_engine_cache_exactly(make_engine, subscriber, monkeypatch, as_int, transfer):
    """With a CPU tier too, blocks loaded from it back into the cache are announced like any other."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if as_int else "0")
    engine = make_engine(num_gpu_blocks=24, block_size=BLOCK_SIZE, kv_transfer_config=parse_kv_transfer_config(transfer),
                         kv_events_config=parse_kv_events_config(_events_config(subscriber)))
    _run_workload(engine)
    publisher = engine.kv_events.publisher
    assert publisher.num_dropped_batches == 0
    got = subscriber.ask(op="collect", until_seq=publisher.num_batches - 1, replay=publisher.replay_endpoint)

    assert got["errors"] == []
    assert got["mismatched_reencodes"] == 0
    assert sorted(set(got["live_seqs"]) | set(got["replayed_seqs"])) == list(range(publisher.num_batches))
    counts = got["counts"]
    assert counts["BlockStored"] > 0 and counts["BlockRemoved"] > 0 and counts["AllBlocksCleared"] == 1
    assert got["num_hash_checks"] >= counts["BlockStored"]
    expected = _cached_hashes(engine, as_int)
    assert len(expected) > 0
    if transfer is not None:
        assert engine.stats().external_tokens_loaded > 0  # blocks came back from the CPU tier
        held = sorted(str(int.from_bytes(k[:-4], "big") & ((1 << 64) - 1)) for k in engine.scheduler.connector.slots.keys())
        assert got["state"].pop("CPU") == held  # the CPU tier announces what it holds too
    assert got["state"] == {"GPU": expected}


def test_replay_serves_missed_batches_from_a_bounded_buffer(make_engine, subscriber):
    engine = make_engine(num_gpu_blocks=24, block_size=BLOCK_SIZE,
                         kv_events_config=parse_kv_events_config(_events_config(subscriber)))
    _run_workload(engine)
    publisher = engine.kv_events.publisher
    n = publisher.num_batches
    # A subscriber that saw nothing asks for everything from seq 0 and rebuilds the same cache.
    late = subscriber.ask(op="replay", replay=publisher.replay_endpoint, from_seq=0)
    assert late["replayed_seqs"] == list(range(n))
    assert late["errors"] == [] and late["mismatched_reencodes"] == 0
    assert late["state"] == {"GPU": _cached_hashes(engine, as_int=True)}
    # From the middle: only what is at or after the asked sequence number.
    tail = subscriber.ask(op="replay", replay=publisher.replay_endpoint, from_seq=n - 2)
    assert tail["replayed_seqs"] == [n - 2, n - 1]


def test_replay_buffer_keeps_the_last_buffer_steps_batches(make_engine, subscriber):
    engine = make_engine(num_gpu_blocks=24, block_size=BLOCK_SIZE,
                         kv_events_config=parse_kv_events_config(_events_config(subscriber, buffer_steps=3)))
    _run_workload(engine)
    n = engine.kv_events.publisher.num_batches
    assert n > 3
    got = subscriber.ask(op="replay", replay=engine.kv_events.publisher.replay_endpoint, from_seq=0)
    assert got["replayed_seqs"] == [n - 3, n - 2, n - 1]


def test_config_fields_and_defaults_are_vllms():
    code = (
        "import dataclasses, json; from vllm.config.kv_events import KVEventsConfig; "
        "print(json.dumps({f.name: f.default for f in dataclasses.fields(KVEventsConfig)}))"
    )
    out = subprocess.run([str(require_peer_python()), "-c", code], env=peer_env(), capture_output=True, text=True,
                         timeout=300, check=True).stdout
    vllm_defaults = json.loads(out.strip().splitlines()[-1])
    from kvtool.engine.events.config import KVEventsConfig

    ours = KVEventsConfig()
    assert list(vllm_defaults) == list(KVEventsConfig.__struct_fields__)
    assert {name: getattr(KVEventsConfig(publisher=None), name) for name in vllm_defaults if name != "publisher"} == {
        name: value for name, value in vllm_defaults.items() if name != "publisher"
    }
    assert ours.publisher == "null"  # vLLM's __post_init__ turns None into "null" when disabled


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ('{"enable_kv_cache_events": true, "replay": "tcp://127.0.0.1:1"}', "unknown field `replay`"),
        (None, "replay_endpoint 'tcp://127.0.0.1:"),
    ],
    ids=["unknown-key", "replay-port-taken"],
)
def test_cli_refuses_with_one_line(doc, needle, tiny_model_dir, run_kvtool):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if doc is None:
            doc = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:9",
                              "replay_endpoint": f"tcp://127.0.0.1:{taken.getsockname()[1]}"})
        code, stdout, stderr = run_kvtool(["generate", "--model", tiny_model_dir, "--kv-cache-memory", "64M",
                                           "--kv-events-config", doc, "--max-tokens", "2", "--prompt", "hi"])
    assert code == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], stderr
    assert "Traceback" not in stderr and stdout == ""


def test_offload_tier_events_decode_as_vllms(subscriber):
    """The events an offloading tier records (media CPU and STORAGE), through the same stream."""
    from kvtool.engine.core.hashing import extend_block_hashes, make_none_hash
    from kvtool.engine.events.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEventStream, OffloadEventRecorder
    from kvtool.engine.events.publisher import ZmqEventPublisher

    config = parse_kv_events_config(_events_config(subscriber))
    stream = KVEventStream(config, BLOCK_SIZE, ZmqEventPublisher(config))
    recorder = OffloadEventRecorder(as_int=True)
    stream.recorders.append(recorder)
    tokens = [(5 * i) % 500 + 3 for i in range(6 * BLOCK_SIZE)]
    hashes = extend_block_hashes([], tokens, BLOCK_SIZE, make_none_hash())
    per = 2  # engine blocks per offload block
    keys = [hashes[(j + 1) * per - 1] + bytes(4) for j in range(3)]

    def store(medium: str, j: int) -> None:
        recorder.stored(medium, keys[j], hashes[j * per : (j + 1) * per], hashes[j * per - 1] if j else None,
                        tokens[j * per * BLOCK_SIZE : (j + 1) * per * BLOCK_SIZE], BLOCK_SIZE)

    try:
        for j in range(3):
            store(MEDIUM_CPU, j)
        stream.drain([])
        store(MEDIUM_STORAGE, 0)
        store(MEDIUM_STORAGE, 1)
        recorder.removed(MEDIUM_CPU, keys[0])
        stream.drain([])
        recorder.removed(MEDIUM_STORAGE, keys[1])
        recorder.removed(MEDIUM_STORAGE, keys[2])  # never stored there: no event
        stream.drain([])
        publisher = stream.publisher
        got = subscriber.ask(op="collect", until_seq=publisher.num_batches - 1, replay=publisher.replay_endpoint)
    finally:
        stream.close()

    def ext(h: bytes) -> str:
        return str(int.from_bytes(h, "big") & ((1 << 64) - 1))

    assert publisher.num_batches == 3
    assert got["errors"] == [] and got["mismatched_reencodes"] == 0
    assert got["num_hash_checks"] == 2 * 5
    assert got["counts"] == {"BlockStored": 5, "BlockRemoved": 2}
    assert got["state"] == {"CPU": sorted(ext(h) for h in hashes[per:]), "STORAGE": sorted(ext(h) for h in hashes[:per])}


@pytest.mark.parametrize("doc", ['{"enable_kv_cache_events": true, "publisher": "null"}', '{"publisher": "zmq"}'])
def test_null_publisher_or_disabled_events_publish_nothing(make_engine, doc):
    engine = make_engine(kv_events_config=parse_kv_events_config(doc))
    assert engine.kv_events is None and engine.scheduler.pool.events is None
    engine.generate([list(range(3, 60))], SamplingParams(max_tokens=2, temperature=0))


def test_offloading_tiers_announce_what_they_hold(make_engine, subscriber, tmp_path):
    """CPU and STORAGE events from the OffloadingConnector's scheduler half: replayed, they give
    exactly the blocks its CPU slot index and its disk index hold (evictions included)."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config

    config = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 6, "root_dir": str(tmp_path / "tier")}}))
    engine = make_engine(num_gpu_blocks=24, block_size=BLOCK_SIZE, kv_transfer_config=config,
                         kv_events_config=parse_kv_events_config(_events_config(subscriber)))
    _run_workload(engine)
    engine.flush_connector()
    engine.generate([[7]], SamplingParams(max_tokens=1, temperature=0))  # reports the last completions
    publisher = engine.kv_events.publisher
    got = subscriber.ask(op="collect", until_seq=publisher.num_batches - 1, replay=publisher.replay_endpoint)

    def ext(h: bytes) -> str:
        return str(int.from_bytes(h, "big") & ((1 << 64) - 1))

    half = engine.scheduler.connector
    cpu = sorted(ext(key[:-4]) for key in half.slots.keys())
    disk = sorted(ext(h) for h in half.disk.indexes[0]._present)
    assert got["errors"] == [] and got["mismatched_reencodes"] == 0
    assert got["counts"]["BlockRemoved"] > 0  # six CPU slots for more blocks: evictions
    assert len(cpu) == 6 and len(disk) > 6
    assert got["state"]["CPU"] == cpu and got["state"]["STORAGE"] == disk
    assert got["state"]["GPU"] == _cached_hashes(engine, True)


def test_hybrid_groups_announce_each_group_and_rebuild_the_cache(subscriber, tmp_path):
    """Gemma 3 with KV cache groups: every group's blocks are announced with its group index,
    kind and window (vLLM 0.33's fields), and the events rebuild the pool per group."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams
    from kvtool.engine.presets.catalog import PRESETS, write_random_model_dir

    preset = PRESETS["tiny-gemma3"]
    model = tmp_path / "gemma3"
    write_random_model_dir(model, {**preset.hf_config, "sliding_window": 32}, seed=2, tokenizer=preset.tokenizer)
    engine = LLMEngine(EngineParams(model=str(model), device="cpu", num_gpu_blocks=48, block_size=BLOCK_SIZE,
                                    max_model_len=512, max_num_batched_tokens=32,
                                    kv_events_config=parse_kv_events_config(_events_config(subscriber))))
    try:
        layout = engine.kv_layout
        assert layout.num_groups > 1
        _run_workload(engine)
        publisher = engine.kv_events.publisher
        got = subscriber.ask(op="collect", until_seq=publisher.num_batches - 1, replay=publisher.replay_endpoint)
        assert got["errors"] == [] and got["mismatched_reencodes"] == 0
        assert got["groups"] == {str(g): [grp.kind, grp.sliding_window] for g, grp in enumerate(layout.groups)}
        assert got["state"] == {"GPU": _cached_hashes(engine, as_int=True)}
        assert any(h.startswith("g1:") for h in got["state"]["GPU"])
    finally:
        engine.close()


def test_offloaded_groups_are_announced_with_their_group(subscriber, tmp_path):
    """Gemma 3 with KV cache groups and a CPU + disk tier: the tiers' BlockStored/BlockRemoved
    carry each offload block's group index (the key's) and the group's kind and window, and
    replayed per medium they give what the CPU slot index and every group's disk index hold."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams
    from kvtool.engine.presets.catalog import PRESETS, write_random_model_dir

    preset = PRESETS["tiny-gemma3"]
    model = tmp_path / "gemma3"
    write_random_model_dir(model, {**preset.hf_config, "sliding_window": 32}, seed=2, tokenizer=preset.tokenizer)
    config = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 12, "root_dir": str(tmp_path / "tier")}}))
    engine = LLMEngine(EngineParams(model=str(model), device="cpu", num_gpu_blocks=48, block_size=BLOCK_SIZE,
                                    max_model_len=512, max_num_batched_tokens=32, kv_transfer_config=config,
                                    kv_events_config=parse_kv_events_config(_events_config(subscriber))))
    try:
        layout = engine.kv_layout
        assert layout.num_groups > 1
        _run_workload(engine)
        engine.flush_connector()
        engine.generate([[7]], SamplingParams(max_tokens=1, temperature=0))  # reports the last completions
        publisher = engine.kv_events.publisher
        got = subscriber.ask(op="collect", until_seq=publisher.num_batches - 1, replay=publisher.replay_endpoint)
        half = engine.scheduler.connector

        def held(keys) -> list[str]:
            out = []
            for key in keys:
                g, h = int.from_bytes(key[-4:], "big"), str(int.from_bytes(key[:-4], "big") & ((1 << 64) - 1))
                out.append(h if g == 0 else f"g{g}:{h}")
            return sorted(out)

        disk = [h + g.to_bytes(4, "big") for g, index in enumerate(half.disk.indexes) for h in index._present]
        specs = {str(g): [grp.kind, grp.sliding_window] for g, grp in enumerate(layout.groups)}
        assert got["errors"] == [] and got["mismatched_reencodes"] == 0
        assert got["counts"]["BlockRemoved"] > 0  # twelve CPU slots for more offload blocks: evictions
        assert got["media_groups"]["CPU"] == specs and got["media_groups"]["STORAGE"] == specs
        assert got["state"]["CPU"] == held(half.slots.keys()) and got["state"]["STORAGE"] == held(disk)
    finally:
        engine.close()
