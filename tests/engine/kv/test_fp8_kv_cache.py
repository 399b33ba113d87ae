"""An fp8 KV cache (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`) on CPU.

The pages hold fp8(x / scale) saturated, read back as fp8 * scale; the scales come from the
checkpoint's tensors (vLLM's names) or are 1.0; output with reuse (prefix cache, the CPU + disk
tier in a new engine, including a sliding-window model with soft caps) equals output without
it, bit for bit; an fp8 cache's logprobs stay within a stated distance of the model dtype's;
and KV stored under another KV dtype or other scales is refused by the disk tier. The bit
identity across batching, chunking and hits on the default model is in
kernels/attention/test_cpu_identity.py (its `/fp8` cases).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.core.hashing import extend_block_hashes
from kvtool.engine.errors import ConfigError, ModelError
from kvtool.engine.kv.identity import identity_for_model, resolve_kv_dtype
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.kv.scales import KVScales, is_attention_scale, kv_scale_target, read_kv_scales
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.catalog import create_model_dir
from tests.support.architecture_checks import PROMPTS, engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _stored(x: torch.Tensor, scale: float, dtype: torch.dtype, limit: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


@pytest.mark.parametrize("dtype,limit", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_pages_store_x_over_scale_saturated_and_read_it_back_times_scale(dtype, limit):
    name = str(dtype).removeprefix("torch.")
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=name)
    pages = KVPages(geometry, 6, torch.device("cpu"), k_scales=[1.0, 0.25], v_scales=[2.0, 3.0])
    assert pages.quantized and geometry.element_size == 1 and geometry.storage_dtype == "uint8"
    g = torch.Generator().manual_seed(0)
    k = torch.randn((6, 2, 8), generator=g) * 40
    k[0, 0, 0] = 1e6  # saturates instead of becoming NaN
    v = torch.randn((6, 2, 8), generator=g)
    blocks, offsets = torch.tensor([3, 3, 3, 3, 5, 5]), torch.tensor([0, 1, 2, 3, 0, 1])
    pages.write(1, k, v, blocks, offsets)
    want_k, want_v = _stored(k, 0.25, dtype, limit), _stored(v, 3.0, dtype, limit)
    assert torch.equal(pages.tensor[blocks, 0, 1, offsets].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pages.tensor[blocks, 1, 1, offsets].view(torch.uint8), want_v.view(torch.uint8))
    assert float(pages.tensor[3, 0, 1, 0, 0, 0]) == limit
    got_k, got_v = pages.read_layer(1, torch.tensor([3, 5]), 6, torch.bfloat16)
    assert torch.equal(got_k, (want_k.float() * 0.25).to(torch.bfloat16))
    assert torch.equal(got_v, (want_v.float() * 3.0).to(torch.bfloat16))
    # The tiers' bytes: a gathered chunk scatters back from its uint8 view (LMCache's dtype).
    chunk = pages.gather([3, 5], "KV_2LTD", 6)
    pages.scatter([0, 1], chunk.view(torch.uint8), "KV_2LTD", 6)
    assert torch.equal(pages.gather([0, 1], "KV_2LTD", 6).view(torch.uint8), chunk.view(torch.uint8))


def test_kv_cache_dtype_names_resolve_as_vllm_reads_them():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    for name in ("int8", "fp8_inc", "fp8_ds_mla", "float16"):
        with pytest.raises(ConfigError, match=f"^--kv-cache-dtype {name}: .*this engine's: auto, bfloat16, fp8"):
            resolve_kv_dtype(name, torch.bfloat16)


def test_checkpoint_kv_scales_are_read_by_vllms_names(tmp_path):
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, "k")
    assert kv_scale_target("model.layers.1.self_attn.v_proj.output_scale") == (1, "v")
    assert kv_scale_target("model.layers.2.self_attn.k_proj.k_scale") == (2, "k")
    assert kv_scale_target("model.layers.2.self_attn.qkv_proj.v_scale") == (2, "v")
    assert kv_scale_target("model.layers.2.self_attn.v_cache.scale") == (2, "v")
    assert kv_scale_target("model.layers.2.self_attn.attn.v_scale") == (2, "v")
    for other in ("model.layers.2.self_attn.k_proj.weight_scale", "model.layers.2.self_attn.k_proj.input_scale",
                  "model.layers.2.mlp.up_proj.output_scale", "model.layers.2.self_attn.q_scale"):
        assert kv_scale_target(other) is None
    assert is_attention_scale("model.layers.2.self_attn.q_scale")
    assert is_attention_scale("model.layers.2.self_attn.prob_output_scale")
    assert not is_attention_scale("model.layers.2.self_attn.k_proj.weight_scale")
    path = tmp_path / "scales.safetensors"
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(0.5),
               "model.layers.2.self_attn.k_proj.output_scale": torch.tensor([0.125], dtype=torch.bfloat16),
               "model.layers.2.self_attn.v_proj.output_scale": torch.tensor([4.0])}, str(path))
    assert read_kv_scales([path], 3) == KVScales((0.5, 1.0, 0.125), (0.5, 1.0, 4.0))
    for bad, why in ((torch.tensor(-1.0), "one positive finite number"), (torch.ones(2), "shape \\[2\\]")):
        save_file({"model.layers.1.self_attn.k_scale": bad}, str(path))
        with pytest.raises(ModelError, match=f"KV scale 'model.layers.1.self_attn.k_scale' must be .*{why}"):
            read_kv_scales([path], 3)
    save_file({"model.layers.7.self_attn.k_scale": torch.tensor(1.0)}, str(path))
    with pytest.raises(ModelError, match="names layer 7; the model has 3$"):
        read_kv_scales([path], 3)
    # vLLM's rule for one side: K's scale stands for V's; V's alone is refused (vLLM asserts K's).
    save_file({"model.layers.1.self_attn.k_scale": torch.tensor(0.25)}, str(path))
    assert read_kv_scales([path], 3) == KVScales((1.0, 0.25, 1.0), (1.0, 0.25, 1.0))
    save_file({"model.layers.1.self_attn.v_scale": torch.tensor(0.25)}, str(path))
    with pytest.raises(ModelError, match="layer 1 has a V scale but no K scale"):
        read_kv_scales([path], 3)


def _with_kv_scales(src, dst, k: float, v: float):
    """A copy of model directory `src` whose checkpoint also holds per-layer K/V scales."""
    shutil.copytree(src, dst)
    from kvtool.engine.models.model_dir import open_model_dir

    n = open_model_dir(dst).config.num_layers
    tensors = {}
    for i in range(n):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k * (1 + i / 8))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst


@pytest.fixture
def tiny(tiny_model_dir):
    return tiny_model_dir


def test_the_identity_names_the_kv_dtype_and_the_scales(tiny, tmp_path):
    scaled = _with_kv_scales(tiny, tmp_path / "scaled", 0.05, 0.02)

    def identity(model, kv_cache_dtype):
        return identity_for_model(model, EngineParams(model=str(model), device="cpu", kv_cache_dtype=kv_cache_dtype))

    plain, fp8, e5m2 = identity(tiny, "auto"), identity(tiny, "fp8"), identity(tiny, "fp8_e5m2")
    assert (plain.kv_dtype, plain.kv_quantization) == ("float32", "none")
    assert (fp8.kv_dtype, fp8.kv_quantization) == ("float8_e4m3fn", "fp8 per-tensor scales 1.0")
    assert (e5m2.kv_dtype, e5m2.geometry.dtype) == ("float8_e5m2", "float8_e5m2")
    assert identity(scaled, "fp8").kv_quantization.startswith("fp8 per-tensor scales sha256:")
    # The checkpoint's scales are ignored by a cache in the model's dtype, as in vLLM.
    assert identity(scaled, "auto").kv_quantization == "none"


def _tier(tmp_path):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"num_cpu_blocks": 64, "root_dir": str(tmp_path / "tier")},
    }))


def _run(model, **overrides):
    e = engine(model, **overrides)
    try:
        out = e.generate(PROMPTS, GREEDY)
        if e.executor.worker.connector is not None:
            e.executor.worker.connector.flush()
        return out
    finally:
        e.close()


@pytest.mark.parametrize("preset,kv_cache_dtype", [("tiny", "fp8"), ("tiny-gemma2", "fp8_e5m2"),
                                                   ("tiny-mistral", "fp8")])
def test_fp8_cache_reuse_equals_no_reuse(preset, kv_cache_dtype, tmp_path):
    """Prefix hits in one engine, then the CPU + disk tier loaded by a new engine: the same
    tokens and logprobs as without reuse (Gemma 2: soft caps and a window; Mistral: a window
    that binds)."""
    model = tmp_path / preset
    create_model_dir(model, preset=preset, seed=1)
    if preset == "tiny-mistral":
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "sliding_window": 40}))
    e = engine(model, kv_cache_dtype=kv_cache_dtype)
    try:
        first = e.generate(PROMPTS, GREEDY)
        again = e.generate(PROMPTS, GREEDY)
    finally:
        e.close()
    assert all(r.stats.num_cached_tokens >= 48 for r in again)
    assert [(r.output_token_ids, r.logprobs) for r in again] == [(r.output_token_ids, r.logprobs) for r in first]

    ktc = _tier(tmp_path)
    without = _run(model, kv_cache_dtype=kv_cache_dtype, kv_transfer_config=ktc, enable_prefix_caching=False)
    reused = _run(model, kv_cache_dtype=kv_cache_dtype, kv_transfer_config=ktc, enable_prefix_caching=False)
    assert all(r.stats.num_external_tokens >= 48 for r in reused)
    assert [(r.output_token_ids, r.logprobs) for r in reused] == [(r.output_token_ids, r.logprobs) for r in without]
    assert [(r.output_token_ids, r.logprobs) for r in without] == [(r.output_token_ids, r.logprobs) for r in first]


def test_kv_stored_under_another_kv_dtype_or_other_scales_is_refused(tiny, tmp_path, run_kvtool):
    """The disk tier loads an fp8 cache's blocks into an engine with its dtype and scales only;
    `kvtool inspect` shows the KV dtype and the scales' digest, and why another engine may not load."""
    ktc = _tier(tmp_path)
    scaled = _with_kv_scales(tiny, tmp_path / "scaled", 0.05, 0.02)
    rescaled = _with_kv_scales(tiny, tmp_path / "rescaled", 0.06, 0.02)
    _run(scaled, kv_cache_dtype="fp8", kv_transfer_config=ktc)
    assert all(r.stats.num_external_tokens >= 48 for r in _run(scaled, kv_cache_dtype="fp8", kv_transfer_config=ktc))
    for model, kv_cache_dtype in ((scaled, "auto"), (scaled, "fp8_e5m2"), (rescaled, "fp8"), (tiny, "fp8")):
        out = _run(model, kv_cache_dtype=kv_cache_dtype, kv_transfer_config=ktc)
        assert all(r.stats.num_external_tokens == 0 for r in out), (model.name, kv_cache_dtype)

    def inspect(kv_cache_dtype):
        code, out, err = run_kvtool(["inspect", str(tmp_path / "tier"), "--model", str(scaled), "--device", "cpu",
                                     "--kv-cache-dtype", kv_cache_dtype, "--json"])
        assert code == 0, err
        report = json.loads(out)
        fp8_groups = [i for i, g in enumerate(report["groups"]) if g["identity"]["kv_dtype"] == "float8_e4m3fn"]
        return report, fp8_groups

    report, groups = inspect("fp8")
    scaled_group = next(i for i in groups if report["loadability"][i]["loadable"])
    assert report["groups"][scaled_group]["identity"]["kv_quantization"].startswith("fp8 per-tensor scales sha256:")
    report, _ = inspect("auto")
    fields = {d["field"] for d in report["loadability"][scaled_group]["differences"]}
    assert not report["loadability"][scaled_group]["loadable"] and {"kv_dtype", "kv_quantization"} <= fields


def test_fp8_logprobs_stay_close_to_the_model_dtypes(tmp_path):
    """The distance an fp8 cache costs, on the embedded default model in float32 with a real
    prompt: each step's logprob of the token the float32 cache chose, fp8 against float32
    KV, differs by at most 0.25 (e4m3: 3 mantissa bits); the first tokens agree."""
    from kvtool.engine.presets.default_model import ensure_default_model

    model = str(ensure_default_model())
    text = "The history of the printing press begins in the fifteenth century, when"
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        e = engine(model, kv_cache_dtype=kv_cache_dtype)
        try:
            prompt = e.tokenizer.encode(text)
            results[kv_cache_dtype] = e.generate([prompt], sampling)[0]
        finally:
            e.close()
    dense, fp8 = results["auto"], results["fp8"]
    assert fp8.output_token_ids[:2] == dense.output_token_ids[:2]
    compared = 0
    for step, token in enumerate(dense.output_token_ids):
        if step and fp8.output_token_ids[:step] != dense.output_token_ids[:step]:
            break  # the contexts differ from here on
        assert token in fp8.logprobs[step]  # within the fp8 cache's top 5 while the contexts agree
        assert abs(fp8.logprobs[step][token] - dense.logprobs[step][token]) <= 0.25
        compared += 1
    assert compared >= 2


def test_calculated_scales_come_from_each_layers_first_kv_and_hold(tiny, tmp_path):
    """--calculate-kv-scales: each layer's scales are max |k| / 200 and max |v| / 100 of the
    first K/V it stores, then fixed (prefix hits give the first run's bits); with a KV connector
    it is refused in one line, since stored KV could not name scales that depend on a batch."""
    e = engine(tiny, kv_cache_dtype="fp8", calculate_kv_scales=True)
    try:
        pages = e.executor.worker.kv_pages
        assert pages.scales_pending and torch.equal(pages.k_scale, torch.ones_like(pages.k_scale))
        first = e.generate(PROMPTS[:1], GREEDY)
        k_scale, v_scale = pages.k_scale.clone(), pages.v_scale.clone()
        assert not pages.scales_pending and bool((k_scale != 1.0).all()) and bool((v_scale > 0).all())
        # Layer 0's K of the first prompt: its largest stored value is fp8 of 200 (k / (max |k| /
        # 200)), one of the two e4m3 values around it (the division may round either way).
        blocks = e.scheduler.pool.find_cached_prefix(
            extend_block_hashes([], PROMPTS[0], e.params.block_size, e.none_hash))
        k0, _ = pages.read_layer(0, blocks, 48)
        assert float(k0.float().abs().max()) in (192.0, 208.0)
        again = e.generate(PROMPTS, GREEDY)
        assert torch.equal(pages.k_scale, k_scale) and torch.equal(pages.v_scale, v_scale)
        assert again[0].stats.num_cached_tokens >= 48
        assert (again[0].output_token_ids, again[0].logprobs) == (first[0].output_token_ids, first[0].logprobs)
    finally:
        e.close()
    with pytest.raises(ConfigError, match="^--calculate-kv-scales with a KV connector: "):
        engine(tiny, kv_cache_dtype="fp8", calculate_kv_scales=True, kv_transfer_config=_tier(tmp_path))


def _vllm_cache_scale_rules():
    """vLLM 0.33's own cache-scale name mappers, read from its source in the peer environment
    (importing it there pulls in packages the peer environment leaves out): Fp8Config's suffix
    table (compressed-tensors' names), then QuantizationConfig's regular expressions."""
    import ast

    from kvtool.peer.env import peer_venv

    root = next(peer_venv().glob("lib/python3*/site-packages/vllm/model_executor/layers/quantization"))

    def table(path, owner, name):
        tree = ast.parse((root / path).read_text())
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == owner)
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_cache_scale_mapper")
        assign = next(n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.targets[0].id == name)
        keys = [k.args[0].value if isinstance(k, ast.Call) else k.value for k in assign.value.keys]
        return list(zip(keys, (v.value for v in assign.value.values)))

    return table("fp8.py", "Fp8Config", "orig_to_new_suffix"), table("base_config.py", "QuantizationConfig",
                                                                     "orig_to_new_regex")


@pytest.mark.peer
def test_kv_scale_names_are_read_as_vllms_own_mappers_map_them():
    import re

    suffixes, patterns = _vllm_cache_scale_rules()
    assert len(suffixes) >= 4 and len(patterns) >= 8

    def vllm_side(name):
        for old, new in suffixes:
            if name.endswith(old):
                name = name[: -len(old)] + new
        for pattern, new in patterns:
            name = re.sub(pattern, new, name)
        m = re.search(r"\.self_attn\.attn\.([kv])_scale$", name)
        return m.group(1) if m else None

    prefix = "model.layers.5.self_attn."
    names = [prefix + n for n in (
        "k_scale", "v_scale", "attn.k_scale", "kv_scale", "k_proj.output_scale", "v_proj.output_scale",
        "k_proj.k_scale", "v_proj.v_scale", "qkv_proj.k_scale", "qkv_proj.v_scale", "k_cache.scale",
        "v_cache.scale", "q_scale", "q_proj.output_scale", "prob_output_scale", "k_zero_point",
        "k_proj.weight_scale", "k_proj.input_scale", "k_proj.weight")]
    for name in names:
        ours = kv_scale_target(name)
        assert (ours and ours[1]) == vllm_side(name), name
        assert ours is None or ours[0] == 5
