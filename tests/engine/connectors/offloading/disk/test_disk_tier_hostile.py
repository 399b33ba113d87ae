"""A booby-trapped disk tier: links, directories, FIFOs, unreadable and sparse files under root_dir.

Nothing outside root_dir may be written, loaded or touched; nothing that is not a regular file
is read; every such file is a refusal naming it, and `inspect --verify` reports it as damage.
Permission cases run in a child process without capabilities (the tests run as root, and root
reads mode-000 files otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
from kvtool.engine.connectors.offloading.disk.tier_identity import (
    TierFileRefused,
    encode_header,
    make_block_header,
    tier_digest,
)
from kvtool.engine.connectors.offloading.disk.tier_report import scan
from kvtool.engine.errors import ConfigError, KVRefused
from tests.conftest import REPO, kvtool_cmd
from tests.support.tier_identity import make_test_identity

IDENTITY = make_test_identity()
HASH = bytes(range(32))
# A guard against a hang, far above what each command needs; not a timing assertion.
HANG_GUARD_S = 60
NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def payload(seed: float = 1.0) -> torch.Tensor:
    return torch.full((IDENTITY.offload_block_bytes // 2,), seed, dtype=torch.bfloat16)


def out_buffer() -> torch.Tensor:
    return torch.empty(IDENTITY.offload_block_bytes // 2, dtype=torch.bfloat16)


def written_tier(root: Path) -> Path:
    """A tier holding HASH; returns the block file's path."""
    with DiskTier(root, IDENTITY) as tier:
        assert tier.write(HASH, 8, payload())
        return tier.path_for(HASH)


def inspect_verify(root: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        (prefix or []) + kvtool_cmd() + ["inspect", str(root), "--verify", "--json"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env=env,
    )


def problems_of(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 1, result.stderr
    return {p["path"]: p["problem"] for p in json.loads(result.stdout)["problems"]}


def test_ledger_link_to_an_outside_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    root = tmp_path / "tier"
    (root / "kv").mkdir(parents=True)
    (root / "kv" / ".ledger").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"\.ledger"):
        DiskTier(root, IDENTITY, capacity_bytes=1 << 20)
    assert outside.read_text() == "keep me"


def test_digest_directory_link_is_refused_and_nothing_written_outside(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    root = tmp_path / "tier"
    (root / "kv").mkdir(parents=True)
    (root / "kv" / tier_digest(IDENTITY)).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskTier(root, IDENTITY)
    assert list(outside.iterdir()) == []
    assert problems_of(inspect_verify(root)) == {f"kv/{tier_digest(IDENTITY)}": "not_regular"}


def test_intermediate_directory_link_is_never_followed_on_write(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    root = tmp_path / "tier"
    with DiskTier(root, IDENTITY) as tier:
        path = tier.path_for(HASH)
        path.parent.parent.mkdir(parents=True)
        path.parent.symlink_to(outside, target_is_directory=True)  # <h[2:4]> points outside
        assert not tier.write(HASH, 8, payload())
        assert not tier.contains(HASH)
    assert list(outside.iterdir()) == []


def test_block_link_to_a_valid_outside_block_is_refused_and_not_touched(tmp_path: Path) -> None:
    outside_root = tmp_path / "outside"
    outside_block = written_tier(outside_root)
    os.utime(outside_block, ns=(10**18, 10**18))
    root = tmp_path / "tier"
    link = written_tier(root)
    link.unlink()
    link.symlink_to(outside_block)
    with DiskTier(root, IDENTITY) as tier:
        assert not tier.contains(HASH)
        with pytest.raises(TierFileRefused, match="symbolic link") as refused:
            tier.read_into(HASH, out_buffer())
        assert refused.value.problem == "not_regular" and isinstance(refused.value, KVRefused)
        tier.touch([HASH])
        assert tier.scan() == []
    assert outside_block.stat().st_mtime_ns == 10**18
    rel = str(link.relative_to(root))
    assert problems_of(inspect_verify(root)) == {rel: "not_regular"}


def test_block_replaced_by_a_directory_is_refused_and_reported(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    path = written_tier(root)
    path.unlink()
    path.mkdir()
    with DiskTier(root, IDENTITY, capacity_bytes=1 << 20) as tier:
        with pytest.raises(TierFileRefused, match="a directory") as refused:
            tier.read_into(HASH, out_buffer())
        assert refused.value.problem == "not_regular"
        assert not tier.contains(HASH)
    report = scan(root, verify=True)
    assert [(p.path, p.problem) for p in report.problems] == [(str(path.relative_to(root)), "not_regular")]
    assert problems_of(inspect_verify(root)) == {str(path.relative_to(root)): "not_regular"}


def test_block_replaced_by_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    path = written_tier(root)
    path.unlink()
    os.mkfifo(path)
    script = textwrap.dedent(f"""
        import torch
        from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
        from kvtool.engine.connectors.offloading.disk.tier_identity import TierFileRefused
        from tests.support.tier_identity import make_test_identity
        identity = make_test_identity()
        with DiskTier({str(root)!r}, identity) as tier:
            try:
                tier.read_into(bytes(range(32)), torch.empty(identity.offload_block_bytes // 2, dtype=torch.bfloat16))
            except TierFileRefused as e:
                print(e.problem, e)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("not_regular") and "a FIFO" in done.stdout
    assert problems_of(inspect_verify(root)) == {str(path.relative_to(root)): "not_regular"}


def test_unreadable_block_file_and_directory_are_refusals_without_capabilities(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    path = written_tier(root)
    with DiskTier(root, IDENTITY) as tier:
        other = tier.path_for(bytes([7]) * 32)
        assert tier.write(bytes([7]) * 32, 8, payload(2.0))
    path.chmod(0)
    other.parent.chmod(0)
    script = textwrap.dedent(f"""
        import torch
        from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
        from kvtool.engine.connectors.offloading.disk.tier_identity import TierFileRefused
        from tests.support.tier_identity import make_test_identity
        identity = make_test_identity()
        with DiskTier({str(root)!r}, identity, capacity_bytes=1 << 20) as tier:
            for h in (bytes(range(32)), bytes([7]) * 32):
                try:
                    tier.read_into(h, torch.empty(identity.offload_block_bytes // 2, dtype=torch.bfloat16))
                    print("loaded")
                except TierFileRefused as e:
                    print(e.problem, e)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(NO_CAPS + [sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=HANG_GUARD_S, env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 2 and all(line.startswith("unreadable") for line in lines), done.stdout
        assert "permission denied" in lines[0] and path.name in lines[0]
        found = problems_of(inspect_verify(root, prefix=NO_CAPS))
        assert found == {
            str(path.relative_to(root)): "unreadable",
            str(other.parent.relative_to(root)): "unreadable",
        }
    finally:
        other.parent.chmod(0o755)
        path.chmod(0o644)


def test_sparse_file_claiming_256_gib_is_named_without_reading_it(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    path = written_tier(root)
    giant = 256 << 30
    header = make_block_header(IDENTITY, HASH.hex(), 8, giant, "0" * 64)
    head = encode_header(header)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + giant)  # a hole: nothing of the payload is on disk
    found = problems_of(inspect_verify(root))
    assert found == {str(path.relative_to(root)): "sparse"}


def test_scan_lists_this_identitys_blocks_from_headers(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    with DiskTier(root, IDENTITY) as tier:
        for i in range(3):
            assert tier.write(bytes([i]) * 32, 8, payload(float(i)))
        tier.path_for(bytes([1]) * 32).write_bytes(b"junk")
    with DiskTier(root, make_test_identity(config_digest="other")) as other:
        assert other.write(bytes([9]) * 32, 8, payload())
    with DiskTier(root, IDENTITY) as tier:
        blocks = tier.scan()
        assert sorted(b.block_hash for b in blocks) == [bytes([0]) * 32, bytes([2]) * 32]
        assert all(b.num_tokens == 8 and b.file_bytes == tier.path_for(b.block_hash).stat().st_size for b in blocks)
        assert len(tier.scan(max_blocks=1)) == 1
