"""The CPU products over oneDNN-reordered weights (`models.cpu_gemm`): a row's bits do not depend
on how many rows are computed with it, for every multiple of ROW_MULTIPLE the CPU path uses, on
the shapes of the presets' models, with 1, 2 or 4 threads; they equal F.linear's to rounding; packing a model frees the
dense matrices and keeps its output; without oneDNN every product stays F.linear; and a step of
a few rows is padded to the smallest multiple (4 or 8) whose rows match larger batches'."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from kvtool.engine.kernels.attention import ROW_MULTIPLE
from kvtool.engine.models import build_model
from kvtool.engine.models.cpu_fused import fuse_cpu_modules
from kvtool.engine.models.cpu_gemm import CpuLinear, few_rows_multiple, pack_cpu_linears
from kvtool.engine.models.fast_paths import apply_fast_paths
from kvtool.engine.models.layers import pad_rows_on_cpu
from kvtool.engine.models.model_dir import parse_config
from kvtool.engine.presets.catalog import PRESETS

# (out, in) of q/k/v, o_proj, gate/up, down_proj and the LM head of the tiny preset, of the
# embedded SmolLM2-135M and of Qwen3-0.6B (whose LM head is left out: 0.6 GB in float32).
SHAPES = {
    "tiny": [(512, 256), (256, 256), (1536, 256), (256, 768), (512, 256)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
}
MAX_ROWS = 1024
ROW_COUNTS = [m for m in range(ROW_MULTIPLE, MAX_ROWS + 1, ROW_MULTIPLE) if m <= 256 or m % 128 == 0 or m == 1008]


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-threads")
def threads(request):
    """Run the test with torch set to this many threads (more than the machine's cores is fine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("model", list(SHAPES))
def test_a_row_does_not_depend_on_the_rows_beside_it(model, threads):
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in SHAPES[model]:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.05
        linear = CpuLinear(weight).reordered()
        x = torch.randn(MAX_ROWS, in_features, generator=gen)
        whole = linear(x)
        differ = [m for m in ROW_COUNTS if not torch.equal(linear(x[-m:].contiguous()), whole[-m:])]
        assert differ == [], f"{model} ({out_features}, {in_features}), {threads} threads: rows differ at {differ} rows"


def test_the_product_is_f_linear_to_rounding_with_bias_and_strided_rows():
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    gate_up = torch.randn(32, 128, generator=gen)
    x = gate_up[:, :64]  # down_proj's input is such a view of the gate/up product
    linear = CpuLinear(weight, bias).reordered()
    assert linear.packed == torch.backends.mkldnn.is_available()
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x), linear(x.contiguous()))
    assert linear(x[:0]).shape == (0, 96)


def _logits(model, config, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for a prompt of `ids` (one sequence, fresh pages)."""
    from kvtool.engine.kernels.attention import AttentionMetadata, SeqSpan, attention_context
    from kvtool.engine.kv.pages import KVGeometry, KVPages

    n = ids.numel()
    g = KVGeometry(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                   block_size=16, dtype="float32")
    pages = KVPages(g, -(-n // 16), torch.device("cpu"))
    pos = torch.arange(n)
    meta = AttentionMetadata(kv_pages=pages, seqs=[SeqSpan(q_start=0, q_len=n, ctx_len=n, block_ids=torch.arange(-(-n // 16)))],
                             slot_block_ids=pos // 16, slot_offsets=pos % 16)
    with torch.inference_mode(), attention_context(meta):
        return model.compute_logits(model(ids, pos))


@pytest.mark.parametrize("tied", [True, False])
def test_packing_frees_the_dense_matrices_and_keeps_the_output(tied):
    config = parse_config(dict(PRESETS["tiny"].hf_config, tie_word_embeddings=tied))
    model = build_model(config, "cpu", torch.float32, "dummy", seed=4)
    products = fuse_cpu_modules(model)
    ids = torch.randint(0, config.vocab_size, (48,), generator=torch.Generator().manual_seed(3))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    embedding = model.model.embed_tokens.weight.clone()

    def logits():
        return _logits(model, config, ids)

    before = logits()
    moved = pack_cpu_linears(products)
    layers = config.num_layers
    assert moved == (4 * layers + 1 if torch.backends.mkldnn.is_available() else 0)
    if moved:
        freed = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                 mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        if not tied:
            freed.append(model.lm_head.weight)
        assert all(p.numel() == 0 for p in freed)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the embedding (a tied head) stays
    after = logits()
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert pack_cpu_linears(products) == 0  # already moved
    assert torch.equal(logits(), after)


def test_without_onednn_the_products_stay_f_linear(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    config = parse_config(PRESETS["tiny"].hf_config)
    model = build_model(config, "cpu", torch.float32, "dummy", seed=4)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    products = fuse_cpu_modules(model)
    before = _logits(model, config, ids)
    assert pack_cpu_linears(products) == 0
    assert torch.equal(_logits(model, config, ids), before)  # the same F.linear products
    attn = model.model.layers[0].self_attn
    assert not attn.qkv_linear.packed and attn.q_proj.weight.numel() > 0
    assert not attn.o_linear.packed and attn.o_proj.weight.numel() > 0 and not model.logits_product.packed

    other = build_model(config, "cpu", torch.float32, "dummy", seed=4)
    chosen = apply_fast_paths(other, "cpu", torch.float32)
    assert chosen.kernels == "cpu" and chosen.packed_weights == 0
    assert set(msgspec_values(chosen.gemm)) == {"torch"}
    assert chosen.few_rows_multiple == other.model.few_rows_multiple == ROW_MULTIPLE
    assert torch.equal(_logits(other, config, ids), before)
    weight = torch.randn(8, 4)
    assert CpuLinear(weight).reordered().weight is weight


def msgspec_values(struct) -> list:
    return list(msgspec.structs.asdict(struct).values())


def test_only_float32_weights_are_reordered():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert CpuLinear(weight).reordered().weight is weight


class _RoundsFewRowsOtherwise(CpuLinear):
    """F.linear, but with its last bit changed while it multiplies fewer than `below` rows."""

    def __init__(self, weight: torch.Tensor, below: int) -> None:
        super().__init__(weight)
        self.below = below

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if x.shape[0] < self.below else y


def test_few_rows_take_the_first_multiple_whose_rows_match():
    gen = torch.Generator().manual_seed(5)
    w, other = torch.randn(32, 16, generator=gen), torch.randn(48, 16, generator=gen)  # one probe per shape
    plain = CpuLinear(w)
    assert few_rows_multiple([plain]) == 4
    assert few_rows_multiple([plain, _RoundsFewRowsOtherwise(other, 8)]) == 8
    assert few_rows_multiple([_RoundsFewRowsOtherwise(other, 9), plain]) == ROW_MULTIPLE
    assert few_rows_multiple([_RoundsFewRowsOtherwise(w, 16)]) == ROW_MULTIPLE


def test_the_chosen_multiple_gives_few_rows_the_bits_of_large_batches(threads):
    """What the runner's packing picks for the embedded model's shapes holds for other inputs
    and against a 1024-row product, and a step is padded to it."""
    gen = torch.Generator().manual_seed(6)
    products = [CpuLinear(torch.randn(out_features, in_features, generator=gen) * 0.05).reordered()
                for out_features, in_features in SHAPES["smollm2-135m"]]
    few = few_rows_multiple(products)
    assert few in (4, 8, ROW_MULTIPLE)
    for p in products:
        x = torch.randn(MAX_ROWS, p.weight.shape[1], generator=gen)
        whole = p(x)
        assert all(torch.equal(p(x[:n]), whole[:n]) for n in range(few, ROW_MULTIPLE + 1, few))
    assert pad_rows_on_cpu(torch.ones(1, 3), few).shape == (few, 3)
    assert pad_rows_on_cpu(torch.ones(17, 3), few).shape == (2 * ROW_MULTIPLE, 3)


def test_packing_sets_the_few_rows_multiple_except_on_tensor_parallel_ranks():
    from kvtool.engine.models.shard_layout import TPRank

    config = parse_config(PRESETS["tiny"].hf_config)
    model = build_model(config, "cpu", torch.float32, "dummy", seed=4)
    assert model.model.few_rows_multiple == ROW_MULTIPLE  # before its fast paths are applied
    chosen = apply_fast_paths(model, "cpu", torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    products = [attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear, model.logits_product]
    few = few_rows_multiple(products) if chosen.packed_weights else ROW_MULTIPLE
    assert model.model.few_rows_multiple == chosen.few_rows_multiple == few

    shard = build_model(config, "cpu", torch.float32, "dummy", seed=4)
    shard.tp = TPRank(2, 0)  # as a rank's shard says it is one (its shapes do not matter here)
    assert apply_fast_paths(shard, "cpu", torch.float32).few_rows_multiple == ROW_MULTIPLE
    assert shard.model.few_rows_multiple == ROW_MULTIPLE
