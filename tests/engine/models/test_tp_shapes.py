"""The shapes of tensor-parallel shards, built on the meta device (no memory, no process group).

Qwen3-8B (32 query heads, 8 KV heads of 128, hidden 4096, intermediate 12288, vocab 151936,
untied) at TP 2, 4 and 8 splits as vLLM splits it; at TP 16 its KV heads are replicated on
pairs of ranks. Every shard is the full shape with one dim cut to the rank's slice, and the
ranks' slices tile the full tensor.
"""

from __future__ import annotations

import msgspec
import pytest

from kvtool.engine.errors import ConfigError
from kvtool.engine.models import build_model, parameter_shapes, rank_heads, shard_slices
from kvtool.engine.models.model_dir import parse_config
from kvtool.engine.models.shard_layout import TPRank
from kvtool.engine.presets.catalog import PRESETS

QWEN3_8B = parse_config(PRESETS["qwen3-8b"].hf_config)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_qwen3_8b_shards_as_vllm_does(size):
    full = parameter_shapes(QWEN3_8B)
    for rank in range(size):
        shapes = parameter_shapes(QWEN3_8B, TPRank(size, rank))
        assert list(shapes) == list(full)
        layer = "model.layers.7."
        assert shapes[layer + "self_attn.q_proj.weight"] == (32 // size * 128, 4096)
        assert shapes[layer + "self_attn.k_proj.weight"] == (8 // size * 128, 4096)
        assert shapes[layer + "self_attn.v_proj.weight"] == (8 // size * 128, 4096)
        assert shapes[layer + "self_attn.o_proj.weight"] == (4096, 32 // size * 128)
        assert shapes[layer + "self_attn.q_norm.weight"] == (128,)
        assert shapes[layer + "mlp.gate_proj.weight"] == (12288 // size, 4096)
        assert shapes[layer + "mlp.up_proj.weight"] == (12288 // size, 4096)
        assert shapes[layer + "mlp.down_proj.weight"] == (4096, 12288 // size)
        assert shapes[layer + "input_layernorm.weight"] == (4096,)
        assert shapes["model.embed_tokens.weight"] == (151936 // size, 4096)
        assert shapes["lm_head.weight"] == (151936 // size, 4096)
        heads = rank_heads(QWEN3_8B, TPRank(size, rank))
        assert (heads.q_start, heads.num_heads) == (rank * 32 // size, 32 // size)
        assert (heads.kv_start, heads.num_kv_heads) == (rank * 8 // size, 8 // size)


@pytest.mark.parametrize("size", [2, 3, 4, 8, 16])
def test_the_ranks_slices_tile_every_tensor(size):
    full = parameter_shapes(QWEN3_8B)
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in range(size):
        tp = TPRank(size, rank)
        shapes, slices = parameter_shapes(QWEN3_8B, tp), shard_slices(QWEN3_8B, tp)
        for name, shape in shapes.items():
            if name not in slices:
                assert shape == full[name], name  # replicated
                continue
            dim, start, count = slices[name]
            assert shape == tuple(count if d == dim else n for d, n in enumerate(full[name])), name
            covered.setdefault(name, []).append((start, count))
    for name, parts in covered.items():
        dim = shard_slices(QWEN3_8B, TPRank(size, 0))[name][0]
        # KV heads are replicated when there are fewer than ranks: each range then repeats.
        distinct = sorted(set(parts))
        assert distinct[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(distinct, distinct[1:])), name
        assert distinct[-1][0] + distinct[-1][1] == full[name][dim], name


def test_fewer_kv_heads_than_ranks_replicate_them():
    for rank in range(16):
        heads = rank_heads(QWEN3_8B, TPRank(16, rank))
        assert (heads.kv_start, heads.num_kv_heads) == (rank // 2, 1)
        assert (heads.q_start, heads.num_heads) == (rank * 2, 2)


def test_uneven_heads_split_by_kv_group():
    smollm2 = msgspec.structs.replace(QWEN3_8B, architecture="LlamaForCausalLM", num_heads=9, num_kv_heads=3,
                                      head_dim=64, hidden_size=576, intermediate_size=1536, vocab_size=49152)
    first, second = (parameter_shapes(smollm2, TPRank(2, r)) for r in range(2))
    assert first["model.layers.0.self_attn.q_proj.weight"] == (6 * 64, 576)
    assert first["model.layers.0.self_attn.k_proj.weight"] == (2 * 64, 576)
    assert second["model.layers.0.self_attn.q_proj.weight"] == (3 * 64, 576)
    assert second["model.layers.0.self_attn.k_proj.weight"] == (1 * 64, 576)
    assert second["model.layers.0.self_attn.o_proj.weight"] == (576, 3 * 64)


def test_a_shard_needs_a_fitting_size_and_its_process_group():
    with pytest.raises(ConfigError, match="does not fit the model"):
        build_model(QWEN3_8B, "cpu", None, "dummy", tp=TPRank(12, 0))
    with pytest.raises(ConfigError, match="torch.distributed is not initialised"):
        build_model(QWEN3_8B, "cpu", None, "dummy", tp=TPRank(2, 1))
