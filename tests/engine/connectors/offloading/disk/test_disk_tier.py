"""Disk tier: atomic files, identity refusal per field, damage detection, LRU capacity, two writers."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import blake3
import msgspec
import pytest
import torch

import kvtool
from kvtool.engine.connectors.offloading.disk import disk_tier as disk_tier_module
from kvtool.engine.connectors.offloading.disk.disk_tier import (
    DiskTier,
    make_temp_name,
    read_file,
    read_ledger,
)
from kvtool.engine.connectors.offloading.disk.tier_identity import (
    COMPARED_FIELDS,
    FORMAT_VERSION,
    KVBlockHeader,
    KVIdentity,
    TierFileRefused,
    encode_header,
    identity_differences,
    make_block_header,
    make_identity,
    payload_checksum,
    refuse_foreign_header,
    tier_digest,
)
from kvtool.engine.connectors.offloading.disk.tier_report import scan
from kvtool.engine.errors import ConfigError, KVRefused
from tests.support.tier_identity import GEOMETRY
from tests.support.tier_identity import make_test_identity as tier_identity


def make_test_identity(**overrides: object) -> KVIdentity:
    """The shared test identity, written by a tensor- and pipeline-parallel rank 0 of 2."""
    return tier_identity(**{"tp_size": 2, "tp_rank": 0, "pp_size": 2, "pp_rank": 0, **overrides})


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def block_tensor(identity: KVIdentity, seed: int) -> torch.Tensor:
    k = identity.offload_block_tokens // identity.block_size
    shape = (k, 2, identity.num_layers, identity.block_size, identity.num_kv_heads, identity.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def file_bytes_of(tier: DiskTier, i: int) -> int:
    return tier.path_for(block_hash(i)).stat().st_size


def all_tier_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "kv").rglob("*") if p.is_file() and p.name != ".ledger")


def problems_by_kind(report) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for p in report.problems:
        kinds.setdefault(p.problem, []).append(p.path)
    return kinds


# -- identity and header


def test_identity_has_at_least_27_fields_and_header_adds_block_fields() -> None:
    assert len(KVIdentity.__struct_fields__) >= 27
    assert set(KVBlockHeader.__struct_fields__) - set(KVIdentity.__struct_fields__) == {
        "block_hash",
        "num_tokens",
        "payload_bytes",
        "payload_checksum",
    }
    identity = make_test_identity()
    assert identity.format_version == FORMAT_VERSION
    assert identity.writer_version == kvtool.__version__
    assert identity.kv_dtype == "bfloat16" and identity.element_size == 2
    assert identity.offload_block_bytes == 2 * 2 * 2 * 8 * 2 * 8


def test_make_identity_refuses_impossible_values() -> None:
    with pytest.raises(ConfigError, match="multiple of the block size"):
        make_identity(
            model_name="m", config_digest="c", weights_digest="w", architecture="a", geometry=GEOMETRY,
            offload_block_tokens=6, none_hash_seed="s", rope_digest="r", engine_id="e",
        )
    with pytest.raises(ConfigError, match="tensor-parallel rank 2"):
        make_identity(
            model_name="m", config_digest="c", weights_digest="w", architecture="a", geometry=GEOMETRY,
            offload_block_tokens=8, none_hash_seed="s", rope_digest="r", engine_id="e", tp_size=2, tp_rank=2,
        )


def test_round_trip_tensor_bytes_and_memoryview(tmp_path: Path) -> None:
    identity = make_test_identity()
    with DiskTier(tmp_path, identity) as tier:
        x = block_tensor(identity, 0)
        assert not tier.contains(block_hash(0))
        assert tier.write(block_hash(0), 8, x)
        assert tier.contains(block_hash(0))
        out = torch.empty_like(x)
        header = tier.read_into(block_hash(0), out)
        assert torch.equal(out, x)
        assert header.num_tokens == 8 and header.payload_bytes == x.numel() * 2
        assert header.block_hash == block_hash(0).hex()

        raw = bytes(range(256)) * 4
        assert tier.write(block_hash(1), 5, raw)
        buf = bytearray(len(raw))
        assert tier.read_into(block_hash(1), memoryview(buf)).num_tokens == 5
        assert bytes(buf) == raw

        path = tier.path_for(block_hash(0))
        assert path.parent.parent.parent.name == tier_digest(identity)
        assert path.name == block_hash(0).hex() + ".kvb"
        assert tier.used_bytes == sum(p.stat().st_size for p in all_tier_files(tmp_path))
    assert not [p for p in all_tier_files(tmp_path) if p.name.endswith(".tmp")]


def test_payload_starts_on_a_4k_boundary_after_zero_padding(tmp_path: Path) -> None:
    identity = make_test_identity()
    x = block_tensor(identity, 5)
    with DiskTier(tmp_path, identity) as tier:
        tier.write(block_hash(0), 8, x)
        path = tier.path_for(block_hash(0))
        data = bytearray(path.read_bytes())
        assert len(data) == 4096 + identity.offload_block_bytes  # O_DIRECT-ready payload offset
        assert data[4096:] == x.reshape(-1).view(torch.uint8).numpy().tobytes()
        data[4095] = 1
        path.write_bytes(bytes(data))
        with pytest.raises(TierFileRefused, match="padding") as e:
            tier.read_into(block_hash(0), torch.empty_like(x))
        assert e.value.problem == "corrupt"


def test_identical_block_is_not_rewritten_but_a_damaged_one_is(tmp_path: Path) -> None:
    identity = make_test_identity()
    with DiskTier(tmp_path, identity) as tier:
        x = block_tensor(identity, 1)
        assert tier.write(block_hash(0), 8, x)
        path = tier.path_for(block_hash(0))
        inode = path.stat().st_ino
        assert tier.write(block_hash(0), 8, x)
        assert path.stat().st_ino == inode  # kept, not replaced

        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(KVRefused, match="torn"):
            tier.read_into(block_hash(0), torch.empty_like(x))
        assert tier.write(block_hash(0), 8, x)  # heals
        assert path.stat().st_ino != inode
        out = torch.empty_like(x)
        tier.read_into(block_hash(0), out)
        assert torch.equal(out, x)
        assert tier.used_bytes == path.stat().st_size


def test_size_mismatch_with_destination_is_refused(tmp_path: Path) -> None:
    identity = make_test_identity()
    with DiskTier(tmp_path, identity) as tier:
        tier.write(block_hash(0), 8, b"\x01" * 64)
        with pytest.raises(TierFileRefused, match="does not fit a 32-byte destination") as e:
            tier.read_into(block_hash(0), bytearray(32))
        assert e.value.problem == "size_mismatch"
        with pytest.raises(TierFileRefused, match="not in the tier") as e:
            tier.read_into(block_hash(9), bytearray(64))
        assert e.value.problem == "missing"


def test_hash_of_the_wrong_length_is_refused_not_missed(tmp_path: Path) -> None:
    with DiskTier(tmp_path, make_test_identity()) as tier:
        offload_key = block_hash(0) + (0).to_bytes(4, "big")  # block hash + group index
        with pytest.raises(ValueError, match="32 bytes, got 36"):
            tier.contains(offload_key)


# One different value per identity field: a tier written under the base identity must be refused
# under the changed one, by its header, with the field and both values named.
FIELD_CHANGES = {
    "checksum_algorithm": "sha256",
    "model_name": "meta-llama/Llama-3.1-8B",
    "config_digest": "cfg-b",
    "weights_digest": "weights-b",
    "architecture": "LlamaForCausalLM",
    "weight_quantization": "fp8",
    "rope_digest": "rope-b",
    "sliding_window": 4096,
    "kv_dtype": "float16",
    "kv_quantization": "fp8_e4m3",
    "num_layers": 3,
    "num_kv_heads": 4,
    "head_dim": 16,
    "element_size": 4,
    "byte_layout": "KV_2LTD",
    "byte_order": "big",
    "block_size": 8,
    "offload_block_tokens": 16,
    "hash_algorithm": "sha256",
    "none_hash_seed": "0",
    "tp_size": 4,
    "tp_rank": 1,
    "pp_size": 4,
    "pp_rank": 1,
}


def test_every_compared_field_has_a_refusal_case() -> None:
    assert set(FIELD_CHANGES) == set(COMPARED_FIELDS) - {"format_version"}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_header_from_another_identity_is_refused_naming_the_field(tmp_path: Path, field: str) -> None:
    writer = make_test_identity()
    reader = make_test_identity(**{field: FIELD_CHANGES[field]})
    x = block_tensor(writer, 2)
    with DiskTier(tmp_path, writer) as tier_w, DiskTier(tmp_path, reader) as tier_r:
        assert tier_w.write(block_hash(0), 8, x)
        # Another identity lives under another directory: a plain miss, never a wrong hit.
        assert tier_r.path_for(block_hash(0)) != tier_w.path_for(block_hash(0))
        assert not tier_r.contains(block_hash(0))
        # Put the file where the reader looks, to prove the header check refuses it.
        target = tier_r.path_for(block_hash(0))
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(tier_w.path_for(block_hash(0)), target)
        out = torch.zeros_like(x)
        with pytest.raises(KVRefused) as e:
            tier_r.read_into(block_hash(0), out)
    message = str(e.value)
    assert e.value.problem == "foreign_identity"
    assert "1 identity field differs" in message
    assert f"{field} (expected {getattr(reader, field)!r}, found {getattr(writer, field)!r})" in message
    assert "\n" not in message
    # The lower-level reader refuses it too.
    with pytest.raises(KVRefused, match=field):
        read_file(target, reader, block_hash(0).hex(), out)


def test_refusal_names_every_differing_field() -> None:
    expected = make_test_identity()
    found = make_test_identity(kv_dtype="float32", block_size=16, none_hash_seed="42")
    diffs = identity_differences(expected, found)
    assert [d.field for d in diffs] == ["kv_dtype", "block_size", "none_hash_seed"]
    with pytest.raises(KVRefused) as e:
        refuse_foreign_header(expected, found)
    message = str(e.value)
    assert "3 identity fields differ" in message
    for needle in ("kv_dtype (expected 'bfloat16', found 'float32')", "block_size (expected 4, found 16)",
                   "none_hash_seed (expected 'vllm-none-hash', found '42')"):
        assert needle in message


def test_provenance_fields_do_not_refuse_and_share_files(tmp_path: Path) -> None:
    writer = make_test_identity()
    other_engine = make_test_identity(engine_id="engine-b", writer_version="9.9.9")
    assert tier_digest(writer) == tier_digest(other_engine)
    x = block_tensor(writer, 3)
    with DiskTier(tmp_path, writer) as tier_w, DiskTier(tmp_path, other_engine) as tier_b:
        tier_w.write(block_hash(0), 8, x)
        assert tier_b.contains(block_hash(0))
        out = torch.empty_like(x)
        assert tier_b.read_into(block_hash(0), out).engine_id == "engine-a"
        assert torch.equal(out, x)


# -- damage


def _write_blocks(tmp_path: Path, n: int) -> tuple[DiskTier, KVIdentity, list[torch.Tensor]]:
    identity = make_test_identity()
    tier = DiskTier(tmp_path, identity)
    blocks = [block_tensor(identity, 10 + i) for i in range(n)]
    for i, x in enumerate(blocks):
        assert tier.write(block_hash(i), 8, x)
    return tier, identity, blocks


def _dead_pid() -> int:
    cmd = [sys.executable, "-c", "import os; print(os.getpid())"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_damage_is_detected_by_verify_and_never_loaded(tmp_path: Path) -> None:
    tier, identity, blocks = _write_blocks(tmp_path, 8)
    paths = [tier.path_for(block_hash(i)) for i in range(8)]

    # 0: truncated payload; 1: truncated inside the header; 2: one flipped payload byte;
    # 3: one flipped header byte; 4: future format version; 5: not a kvtool file;
    # 6: a valid file under another block's name.
    size = paths[0].stat().st_size
    os.truncate(paths[0], size - 100)
    os.truncate(paths[1], 20)
    data = bytearray(paths[2].read_bytes())
    data[len(data) - 100] ^= 0x01
    paths[2].write_bytes(bytes(data))
    data = bytearray(paths[3].read_bytes())
    data[40] ^= 0x20
    paths[3].write_bytes(bytes(data))
    payload = blocks[4].reshape(-1).view(torch.uint8).numpy().tobytes()
    header = make_block_header(identity, block_hash(4).hex(), 8, len(payload), payload_checksum(payload))
    paths[4].write_bytes(encode_header(msgspec.structs.replace(header, format_version=FORMAT_VERSION + 1)) + payload)
    paths[5].write_bytes(b"GGUF" + os.urandom(4000))
    tier.path_for(block_hash(99)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(paths[6], tier.path_for(block_hash(99)))  # block 6's bytes under block 99's name
    # Leftover temporary files: a dead writer's, an old one's, and a live writer's (in flight).
    leftover = paths[7].parent / make_temp_name(paths[7].name).replace(f".{os.getpid()}.", f".{_dead_pid()}.")
    leftover.write_bytes(b"KVTOOLKV" + b"\0" * 100)
    old = paths[7].parent / (make_temp_name(block_hash(50).hex() + ".kvb"))
    old.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    in_flight = paths[7].parent / make_temp_name(block_hash(51).hex() + ".kvb")
    in_flight.write_bytes(b"writing")

    headers_only = problems_by_kind(scan(tmp_path))
    assert "torn" not in headers_only  # payloads are not read without verify

    report = scan(tmp_path, verify=True)
    kinds = problems_by_kind(report)
    rel = lambda p: str(p.relative_to(tmp_path))  # noqa: E731
    assert kinds["truncated"] == sorted([rel(paths[0]), rel(paths[1])])
    assert kinds["torn"] == [rel(paths[2])]
    assert kinds["corrupt"] == [rel(paths[3])]
    assert kinds["future_format"] == [rel(paths[4])]
    assert kinds["foreign_format"] == [rel(paths[5])]
    assert kinds["misplaced"] == [rel(tier.path_for(block_hash(99)))]
    assert sorted(kinds["orphaned_temp"]) == sorted([rel(leftover), rel(old)])
    assert report.num_temp_files_in_flight == 1
    assert report.num_blocks == 1 and report.has_damage
    assert report.num_damaged == 9
    future = next(p for p in report.problems if p.problem == "future_format")
    assert f"future format version {FORMAT_VERSION + 1}" in future.detail

    expected_problem = {
        0: "truncated", 1: "truncated", 2: "torn", 3: "corrupt", 4: "future_format", 5: "foreign_format"
    }
    for i, problem in expected_problem.items():
        with pytest.raises(TierFileRefused) as e:
            tier.read_into(block_hash(i), torch.empty_like(blocks[i]))
        assert e.value.problem == problem, (i, str(e.value))
    with pytest.raises(TierFileRefused) as e:
        tier.read_into(block_hash(99), torch.empty_like(blocks[6]))
    assert e.value.problem == "misplaced"
    # A temporary file is never a block.
    assert not tier.contains(block_hash(50))
    out = torch.empty_like(blocks[7])
    tier.read_into(block_hash(7), out)
    assert torch.equal(out, blocks[7])

    # A tier with a capacity recounts at start and removes orphaned temp files only.
    DiskTier(tmp_path, identity, capacity_bytes=1 << 30).close()
    assert not leftover.exists() and not old.exists() and in_flight.exists()
    tier.close()


def test_full_disk_returns_false_and_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    identity = make_test_identity()
    with DiskTier(tmp_path, identity) as tier:
        real_write_all = disk_tier_module._write_all

        def write_then_fail(fd: int, data: object) -> None:
            real_write_all(fd, memoryview(data)[:10])  # type: ignore[arg-type]
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_tier_module, "_write_all", write_then_fail)
        assert tier.write(block_hash(0), 8, block_tensor(identity, 0)) is False
        monkeypatch.undo()
        assert all_tier_files(tmp_path) == []
        assert not tier.contains(block_hash(0))
        assert tier.used_bytes == 0


def test_unusable_root_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="not usable"):
        DiskTier(blocker, make_test_identity())


# -- capacity


def test_capacity_evicts_least_recently_used_first(tmp_path: Path) -> None:
    identity = make_test_identity()
    x = [block_tensor(identity, 20 + i) for i in range(6)]
    probe = DiskTier(tmp_path / "probe", identity)
    probe.write(block_hash(0), 8, x[0])
    per_file = file_bytes_of(probe, 0)
    probe.close()

    capacity = 3 * per_file + per_file // 2
    with DiskTier(tmp_path / "tier", identity, capacity_bytes=capacity) as tier:
        for i in range(3):
            assert tier.write(block_hash(i), 8, x[i])
        tier.read_into(block_hash(0), torch.empty_like(x[0]))  # 0 is now the most recent
        assert tier.write(block_hash(3), 8, x[3])
        assert [tier.contains(block_hash(i)) for i in range(4)] == [True, False, True, True]
        tier.touch([block_hash(2)])
        assert tier.write(block_hash(4), 8, x[4])
        assert [tier.contains(block_hash(i)) for i in range(5)] == [False, False, True, True, True]
        on_disk = sum(p.stat().st_size for p in all_tier_files(tmp_path / "tier"))
        assert on_disk <= capacity
        assert tier.used_bytes == on_disk
        ledger = read_ledger(tmp_path / "tier")
        assert ledger is not None and ledger.capacity_bytes == capacity

        # Lowering the capacity evicts down to it, oldest first.
        tier.capacity_bytes = per_file
        assert tier.evict_to_capacity() == 2 * per_file
        assert [tier.contains(block_hash(i)) for i in (2, 3, 4)] == [False, False, True]

        # A block larger than the whole capacity is not stored.
        tier.capacity_bytes = per_file - 1
        assert tier.write(block_hash(5), 8, x[5]) is False
        assert not tier.contains(block_hash(5))


def test_capacity_is_shared_by_every_identity_in_the_root(tmp_path: Path) -> None:
    a = make_test_identity()
    b = make_test_identity(model_name="other")
    xa = [block_tensor(a, 30 + i) for i in range(4)]
    with DiskTier(tmp_path, a) as tier_a:
        tier_a.write(block_hash(0), 8, xa[0])
        per_file = file_bytes_of(tier_a, 0)
    capacity = 2 * per_file
    with (
        DiskTier(tmp_path, a, capacity_bytes=capacity) as tier_a,
        DiskTier(tmp_path, b, capacity_bytes=capacity) as tier_b,
    ):
        tier_b.write(block_hash(1), 8, xa[1])
        tier_a.write(block_hash(2), 8, xa[2])  # evicts a's block 0, the oldest in the root
        assert not tier_a.contains(block_hash(0))
        assert tier_b.contains(block_hash(1)) and tier_a.contains(block_hash(2))
        on_disk = sum(p.stat().st_size for p in all_tier_files(tmp_path))
        assert on_disk <= capacity and tier_b.used_bytes == on_disk


def test_reopening_with_a_smaller_capacity_evicts_at_start(tmp_path: Path) -> None:
    identity = make_test_identity()
    with DiskTier(tmp_path, identity) as tier:
        for i in range(4):
            tier.write(block_hash(i), 8, block_tensor(identity, 40 + i))
        per_file = file_bytes_of(tier, 0)
        tier.touch([block_hash(0)])
    with DiskTier(tmp_path, identity, capacity_bytes=2 * per_file) as tier:
        assert [tier.contains(block_hash(i)) for i in range(4)] == [True, False, False, True]
        assert tier.used_bytes == 2 * per_file


# -- several processes


_WRITER = textwrap.dedent(
    """
    import os, sys, time, msgspec, blake3
    from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
    from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity
    from kvtool.engine.errors import KVRefused

    root, identity_json, capacity, barrier, ids = sys.argv[1:6]
    identity = msgspec.json.decode(identity_json, type=KVIdentity)
    ids = [int(i) for i in ids.split(",")]
    size = identity.offload_block_bytes

    def payload(i):
        return blake3.blake3(str(i).encode()).digest(length=size)

    def key(i):
        return blake3.blake3(b"key" + str(i).encode()).digest()

    tier = DiskTier(root, identity, capacity_bytes=int(capacity))
    open(os.path.join(barrier, f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(barrier, "go")):
        time.sleep(0.001)
    buf = bytearray(size)
    bad = 0
    for n, i in enumerate(ids):
        if not tier.write(key(i), 8, payload(i)):
            bad += 1
        j = ids[(n * 7) % len(ids)]
        try:
            tier.read_into(key(j), buf)
            if bytes(buf) != payload(j):
                bad += 1
        except KVRefused as e:
            if e.problem != "missing":
                print("refused:", e, file=sys.stderr)
                bad += 1
    sys.exit(1 if bad else 0)
    """
)


def _run_writers(tmp_path: Path, identity: KVIdentity, capacity: int, id_lists: list[list[int]]) -> None:
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(kvtool.__file__).resolve().parents[1]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path / "root"), msgspec.json.encode(identity).decode(),
             str(capacity), str(barrier), ",".join(map(str, ids))],
            env=env, stderr=subprocess.PIPE, text=True,
        )
        for ids in id_lists
    ]
    deadline = time.time() + 60
    while len(list(barrier.glob("ready-*"))) < len(procs) and time.time() < deadline:
        time.sleep(0.01)
    (barrier / "go").touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


def _key(i: int) -> bytes:
    return blake3.blake3(b"key" + str(i).encode()).digest()


def test_two_processes_writing_the_same_blocks_leave_only_whole_files(tmp_path: Path) -> None:
    identity = make_test_identity(offload_block_tokens=256)  # 64 KiB payloads
    shared = list(range(60))
    own_a, own_b = [100 + i for i in range(10)], [200 + i for i in range(10)]
    _run_writers(tmp_path, identity, 0, [shared + own_a, shared[::-1] + own_b])

    report = scan(tmp_path / "root", verify=True)
    assert report.problems == [] and report.num_temp_files_in_flight == 0
    assert report.num_blocks == 80 and len(report.groups) == 1
    with DiskTier(tmp_path / "root", identity) as tier:
        assert tier.used_bytes == report.block_bytes
        buf = bytearray(identity.offload_block_bytes)
        for i in shared + own_a + own_b:
            tier.read_into(_key(i), buf)
            assert bytes(buf) == blake3.blake3(str(i).encode()).digest(length=len(buf))


def test_concurrent_writers_under_a_capacity_never_exceed_it(tmp_path: Path) -> None:
    identity = make_test_identity(offload_block_tokens=256)
    file_size = identity.offload_block_bytes + len(
        encode_header(make_block_header(identity, _key(0).hex(), 8, identity.offload_block_bytes, "0" * 64))
    )
    capacity = 20 * file_size + file_size // 2
    _run_writers(tmp_path, identity, capacity, [list(range(0, 60)), list(range(30, 90)), list(range(60, 120))])

    report = scan(tmp_path / "root", verify=True)
    assert report.problems == [] and report.num_temp_files_in_flight == 0
    assert report.block_bytes <= capacity
    assert report.num_blocks == 20
    ledger = read_ledger(tmp_path / "root")
    assert ledger is not None and ledger.used_bytes == report.block_bytes
