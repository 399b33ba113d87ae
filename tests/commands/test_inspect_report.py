"""`kvtool inspect`: the tier report (groups, problems, loadability), its table and its JSON."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import msgspec
import pytest
import torch
import typer
from rich.console import Console
from typer.testing import CliRunner

from kvtool.commands.inspect import identity_for_model_dir, inspect, render_report, run_inspect
from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity, tier_digest
from kvtool.engine.connectors.offloading.disk.tier_report import TierReport, loadability, scan, with_loadability
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams
from tests.support.tier_identity import make_test_identity


A = make_test_identity()
A_OTHER_ENGINE = make_test_identity(engine_id="engine-b")  # provenance only: same digest
B = make_test_identity(kv_dtype="float32", element_size=4, block_size=8)


def fill_tier(root: Path) -> None:
    """3 blocks under A, 1 under A from another engine, 2 under B."""
    for identity, ids in ((A, range(3)), (A_OTHER_ENGINE, range(3, 4)), (B, range(4, 6))):
        with DiskTier(root, identity, capacity_bytes=1 << 20) as tier:
            for i in ids:
                assert tier.write(bytes([i]) * 32, 8, torch.full((512,), float(i), dtype=torch.bfloat16))


def damage_one_payload(root: Path) -> Path:
    with DiskTier(root, A) as tier:
        path = tier.path_for(bytes([0]) * 32)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    return path


def test_scan_groups_distinct_headers_with_counts_and_capacity(tmp_path: Path) -> None:
    fill_tier(tmp_path)
    done: list[tuple[int, int]] = []
    report = scan(tmp_path, progress=lambda n, total: done.append((n, total)))
    assert done[-1] == (6, 6)  # after each batch, ending with every file
    assert not report.verified and report.num_files == 6 and report.num_blocks == 6
    assert report.problems == [] and report.num_damaged == 0
    by_identity = {g.identity: g for g in report.groups}
    assert set(by_identity) == {A, A_OTHER_ENGINE, B}
    assert [g.num_blocks for g in report.groups] == [3, 2, 1]  # largest group first
    assert by_identity[A].tier_digest == by_identity[A_OTHER_ENGINE].tier_digest == tier_digest(A)
    assert by_identity[B].num_tokens == 16
    assert all(g.oldest_used_at <= g.newest_used_at for g in report.groups)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kvb"))
    assert report.block_bytes == report.tier_bytes == report.total_bytes == on_disk
    assert report.capacity_bytes == 1 << 20
    assert report.capacity_used == pytest.approx(on_disk / (1 << 20))


def test_loadability_names_each_differing_field(tmp_path: Path) -> None:
    fill_tier(tmp_path)
    report = scan(tmp_path, verify=True)
    in_order = loadability(report, A)
    assert [(v.tier_digest, v.num_blocks) for v in in_order] == [(g.tier_digest, g.num_blocks) for g in report.groups]
    verdicts = {v.tier_digest: v for v in in_order}
    assert verdicts[tier_digest(A)].loadable
    assert verdicts[tier_digest(A)].reason == "loadable: identity matches, payloads verified"
    refused = verdicts[tier_digest(B)]
    assert not refused.loadable and refused.num_blocks == 2
    assert [(d.field, d.expected, d.found) for d in refused.differences] == [
        ("kv_dtype", "bfloat16", "float32"),
        ("element_size", 2, 4),
        ("block_size", 4, 8),
    ]
    assert "kv_dtype (expected 'bfloat16', found 'float32')" in refused.reason
    # An engine that differs only in provenance loads both A groups.
    loadable = [v.loadable for v in loadability(report, make_test_identity(engine_id="engine-z"))]
    assert sorted(loadable) == [False, True, True]


def test_json_is_one_document_that_decodes_back(tmp_path: Path) -> None:
    fill_tier(tmp_path)
    damage_one_payload(tmp_path)
    report = scan(tmp_path, verify=True)
    text = render_report(report, identity=B, json=True)
    assert isinstance(text, str)
    doc = json.loads(text)
    assert set(doc) == set(TierReport.__struct_fields__)
    assert doc["verified"] is True and doc["num_damaged"] == 1
    assert doc["problems"][0]["problem"] == "torn"
    assert doc["problems"][0]["path"].startswith("kv/" + tier_digest(A))
    assert len(doc["groups"][0]["identity"]) >= 27
    assert {v["loadable"] for v in doc["loadability"]} == {True, False}
    back = msgspec.json.decode(text, type=TierReport)
    assert back.groups == report.groups and back.loadability == loadability(report, B)


def test_table_shows_every_field_once_per_group_and_marks_refusals(tmp_path: Path) -> None:
    fill_tier(tmp_path)
    damage_one_payload(tmp_path)
    report = with_loadability(scan(tmp_path, verify=True), A)
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(render_report(report, identity=A))
    text = out.getvalue()
    for field in KVIdentity.__struct_fields__:
        assert sum(1 for line in text.splitlines() if line.startswith(f"│ {field} ")) == 1, field
    for group in report.groups:
        assert group.tier_digest in text
    assert "--model engine" in text
    assert "no: kv_dtype, element_size, block_size" in text
    assert "torn" in text and "payload checksum mismatch" in text


def test_run_inspect_exit_status_and_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill_tier(tmp_path)
    assert run_inspect(tmp_path, verify=True, json=True) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["num_blocks"] == 6 and err == ""

    damage_one_payload(tmp_path)
    assert run_inspect(tmp_path, verify=False, json=True) == 0  # headers only: not seen, not asked
    capsys.readouterr()
    assert run_inspect(tmp_path, verify=True, json=True, identity=A) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)  # exactly one document: json.loads refuses trailing data
    assert doc["num_damaged"] == 1 and doc["loadability"] is not None
    assert err == ""

    assert run_inspect(tmp_path, verify=True, json=False) == 1
    out, _ = capsys.readouterr()
    assert "identity groups" in out and "torn" in out


def test_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as e:
        run_inspect(tmp_path / "absent", verify=False, json=False)
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)


def test_empty_root_is_an_empty_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_inspect(tmp_path, verify=True, json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_files"] == 0 and doc["groups"] == [] and doc["oldest_used_at"] is None


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(inspect)
    return app


def test_cli_verify_json_exits_1_on_damage(tmp_path: Path) -> None:
    fill_tier(tmp_path)
    damage_one_payload(tmp_path)
    runner = CliRunner()
    result = runner.invoke(_app(), [str(tmp_path), "--verify", "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["problems"][0]["problem"] == "torn"
    result = runner.invoke(_app(), [str(tmp_path)])
    assert result.exit_code == 0 and "identity groups" in result.stdout
    result = runner.invoke(_app(), [str(tmp_path / "absent")])
    assert isinstance(result.exception, ConfigError)


def test_cli_model_names_what_that_model_could_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    """--model computes the identity the engine would write under (no engine is built) and
    marks that identity's group loadable, every other one not."""
    fill_tier(tmp_path / "tier")
    params = EngineParams(model=str(tiny_model_dir), block_size=8, device="cpu", load_format="dummy")
    own = identity_for_model_dir(tiny_model_dir, params)
    assert own.block_size == 8 and own.model_name == str(tiny_model_dir)
    with DiskTier(tmp_path / "tier", own) as tier:
        assert tier.write(bytes([9]) * 32, 8, torch.zeros(own.offload_block_bytes // 4, dtype=torch.float32))
    args = [str(tmp_path / "tier"), "--model", str(tiny_model_dir), "--block-size", "8", "--device", "cpu",
            "--load-format", "dummy", "--json"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    verdicts = {v["tier_digest"]: v for v in json.loads(result.stdout)["loadability"]}
    assert verdicts[tier_digest(own)]["loadable"] is True
    assert verdicts[tier_digest(A)]["loadable"] is False and verdicts[tier_digest(B)]["loadable"] is False


def test_headers_only_scan_leaves_payload_checks_to_verify(tmp_path: Path) -> None:
    # A payload the size of a real block: the headers-only scan must not touch it.
    identity = make_test_identity(offload_block_tokens=4096)
    with DiskTier(tmp_path, identity) as tier:
        for i in range(4):
            tier.write(bytes([i]) * 32, 4096, os.urandom(identity.offload_block_bytes))
        path = tier.path_for(bytes([1]) * 32)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert scan(tmp_path).problems == []
    assert [p.problem for p in scan(tmp_path, verify=True).problems] == ["torn"]
