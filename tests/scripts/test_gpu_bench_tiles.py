"""scripts/gpu-bench.py --tiles: the engines of a run take, per product shape, the fastest tiles
a `tiles` run found at the fewest rows it timed that hold the product's rows, and their
configured tiles everywhere else (and wherever a candidate's bits differed)."""

import importlib.util
import json

from tests.conftest import REPO


def _gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "scripts" / "gpu-bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_swept_tiles_are_chosen_by_shape_and_row_count(tmp_path):
    bench = _gpu_bench()
    rows = [
        {"section": "tiles", "n": 64, "k": 32, "rows": 8, "best": [16, 32, 256, 4, 4], "differing_bits": []},
        {"section": "tiles", "n": 64, "k": 32, "rows": 1, "best": [16, 16, 512, 4, 3], "differing_bits": []},
        {"section": "tiles", "n": 64, "k": 48, "rows": 1, "best": [16, 16, 64, 4, 3],
         "differing_bits": [[16, 64, 64, 4, 3]]},
        {"section": "decode", "metric": "not a tiles row"},
    ]
    path = tmp_path / "tiles.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    best = bench.swept_tiles(path)
    assert bench.swept_config(best, 1, 64, 32) == (16, 16, 512, 4, 3)
    assert bench.swept_config(best, 5, 64, 32) == bench.swept_config(best, 8, 64, 32) == (16, 32, 256, 4, 4)
    assert bench.swept_config(best, 9, 64, 32) is None  # more rows than the sweep timed: the configured tiles
    assert bench.swept_config(best, 1, 32, 64) is None  # a shape the sweep did not time
    assert bench.swept_config(best, 1, 64, 48) is None  # a sweep whose candidates' bits differed is not used


def test_fp8_tile_candidates_keep_the_rounding_of_the_configured_tiles():
    """`fp8-tiles` times only row tiles the FP8 kernel computes with the same bits (at least
    fp8_gemm.MIN_BM rows), the larger ones only where the rows fill more than one."""
    bench = _gpu_bench()
    for rows in (1, 64, 65, 256, 8192):
        candidates = bench.fp8_tile_candidates(rows, 64)
        assert candidates and all(bm >= 64 for bm, _, _, _ in candidates)
        assert (max(bm for bm, _, _, _ in candidates) > 64) == (rows > 64)
        assert len(set(candidates)) == len(candidates)


def test_the_fastest_tiles_are_those_with_the_configured_bits():
    """`fastest_tiles` (both tile sweeps): a candidate that fails to compile is skipped, one whose
    bits differ is reported and never chosen, and the fastest of the rest wins over the default."""
    import torch

    bench = _gpu_bench()
    times = {"default": 2.0, "slow": 3.0, "fast-but-other-bits": 0.5, "faster": 1.0}
    last = []

    def product(cfg):
        if cfg == "too-large":
            raise RuntimeError("OutOfResources")
        last.append(cfg)
        return torch.ones(3) * (2 if cfg == "fast-but-other-bits" else 1)

    def timed(fn):
        fn()
        return times[last[-1]]

    bench.bench = timed
    best, best_ms, default_ms, differ = bench.fastest_tiles(
        product, "default", ["slow", "too-large", "fast-but-other-bits", "faster"], "test")
    assert (best, best_ms, default_ms, differ) == ("faster", 1.0, 2.0, ["fast-but-other-bits"])


def test_swept_fp8_tiles_and_prefill_launches_are_read_by_section(tmp_path):
    """--tiles also takes `fp8-tiles` rows (by shape and row count, as `tiles` rows) and
    `prefill-tiles` rows (one launch per head size and window), each only where no candidate's
    bits differed, and never mixes one sweep's rows into another's."""
    bench = _gpu_bench()
    rows = [
        {"section": "fp8-tiles", "n": 4096, "k": 4096, "rows": 8192, "best": [128, 256, 8, 3], "differing_bits": []},
        {"section": "tiles", "n": 4096, "k": 4096, "rows": 1, "best": [16, 16, 512, 4, 3], "differing_bits": []},
        {"section": "prefill-tiles", "head_dim": 256, "window": None, "best": [128, 8, 2], "differing_bits": []},
        {"section": "prefill-tiles", "head_dim": 256, "window": 1024, "best": [128, 8, 1], "differing_bits": []},
        {"section": "prefill-tiles", "head_dim": 128, "window": 300, "best": [64, 4, 1],
         "differing_bits": [[64, 4, 2]]},
    ]
    path = tmp_path / "sweeps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fp8 = bench.swept_tiles(path, "fp8-tiles")
    assert bench.swept_config(fp8, 8192, 4096, 4096) == (128, 256, 8, 3)
    assert bench.swept_config(fp8, 1, 4096, 4096) == (128, 256, 8, 3)
    assert bench.swept_config(bench.swept_tiles(path), 2, 4096, 4096) is None
    assert bench.swept_launches(path) == {(256, 0): (128, 8, 2), (256, 1024): (128, 8, 1)}
