"""`models.fast_paths.apply_fast_paths` decides every fast path in one call and says what it chose;
the modules then carry their choice in declared fields (no forward rebound on an instance); the
runner takes the choice as a value; and a step's row invariance is an argument of that step,
never process state, so engines of different settings in one process cannot affect each other."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.kernels.attention import ROW_MULTIPLE, AttentionMetadata, SeqSpan, attention_context
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.models import build_model
from kvtool.engine.models.cpu_fused import fuse_cpu_modules
from kvtool.engine.models.fast_paths import FastPaths, apply_fast_paths
from kvtool.engine.models.layers import CausalLM, DecoderLayer, DecoderModel, GatedMLP, RMSNorm
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.model_dir import parse_config
from kvtool.engine.presets.catalog import PRESETS
from kvtool.engine.worker.model_runner import ModelRunner

ENGINE = Path(__file__).resolve().parents[3] / "kvtool" / "engine"
CONFIG = parse_config(PRESETS["tiny"].hf_config)
FIELDS = {RMSNorm: "fast_forward", LlamaAttention: "fast_forward", GatedMLP: "fast_forward",
          DecoderLayer: "fast_forward_rows", DecoderModel: "fast_forward", CausalLM: "logits_product"}


def _model(dtype: torch.dtype = torch.float32) -> CausalLM:
    return build_model(CONFIG, "cpu", dtype, "dummy", seed=2)


def _rebound(model: nn.Module) -> list[str]:
    """Modules whose instance holds its own `forward`/`forward_rows` or any bound method."""
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in ("forward", "forward_rows") or isinstance(value, types.MethodType):
                found.append(f"{name or 'model'}.{attr}")
    return found


def _fields(model: nn.Module) -> dict[str, bool]:
    """Each declared field's class name -> whether every module of that class has it set."""
    seen: dict[str, bool] = {}
    for module in model.modules():
        for cls, field in FIELDS.items():
            if isinstance(module, cls):
                key = f"{cls.__name__}.{field}"
                seen[key] = seen.get(key, True) and getattr(module, field) is not None
    return seen


def test_cpu_choices_are_returned_and_no_forward_is_rebound():
    model = _model()
    chosen = apply_fast_paths(model, "cpu", torch.float32)
    packs = torch.backends.mkldnn.is_available()
    route = "onednn" if packs else "torch"
    assert chosen == FastPaths(
        kernels="cpu", fused_qkv=True, fused_gate_up=True, residual_in_norm=False, sampled_rows_only=True,
        gemm=msgspec.convert(dict.fromkeys(("qkv", "o_proj", "gate_up", "down_proj", "lm_head"), route),
                             type(chosen.gemm)),
        packed_weights=4 * CONFIG.num_layers + 1 if packs else 0,
        few_rows_multiple=model.model.few_rows_multiple,
    )
    assert chosen.few_rows_multiple in ((4, 8, ROW_MULTIPLE) if packs else (ROW_MULTIPLE,))
    assert _rebound(model) == []
    assert _fields(model) == {"CausalLM.logits_product": True, "DecoderModel.fast_forward": False,
                              "RMSNorm.fast_forward": True, "DecoderLayer.fast_forward_rows": True,
                              "LlamaAttention.fast_forward": True, "GatedMLP.fast_forward": True}
    assert msgspec.json.decode(msgspec.json.encode(chosen), type=FastPaths) == chosen  # a plain value


def test_without_fusion_every_module_runs_its_own_forward():
    model = _model()
    chosen = apply_fast_paths(model, "cpu", torch.float32, fused=False)
    assert (chosen.kernels, chosen.fused_qkv, chosen.packed_weights) == ("reference", False, 0)
    assert set(msgspec.structs.asdict(chosen.gemm).values()) == {"torch"}
    assert chosen.sampled_rows_only  # on CPU the plain forward's sampled rows keep their bits too
    assert not any(_fields(model).values()) and _rebound(model) == []


def test_a_bfloat16_model_on_cpu_is_fused_but_keeps_dense_products():
    chosen = apply_fast_paths(_model(torch.bfloat16), "cpu", torch.bfloat16)
    assert chosen.kernels == "cpu" and chosen.packed_weights == 0
    assert set(msgspec.structs.asdict(chosen.gemm).values()) == {"torch"}
    assert chosen.few_rows_multiple == ROW_MULTIPLE


def test_the_runner_takes_the_choice_it_is_given():
    geometry = KVGeometry(num_layers=CONFIG.num_layers, num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim,
                          block_size=16, dtype="float32")
    model = _model()
    chosen = apply_fast_paths(model, "cpu", torch.float32)
    runner = ModelRunner(model, KVPages(geometry, 4, torch.device("cpu")), torch.device("cpu"), chosen)
    assert runner.fast_paths is chosen and runner.sampled_rows_only
    assert _rebound(model) == []


def test_fused_and_plain_forwards_agree_to_rounding():
    plain, fused = _model(), _model()
    fuse_cpu_modules(fused)
    ids = torch.randint(0, CONFIG.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    geometry = KVGeometry(num_layers=CONFIG.num_layers, num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim,
                          block_size=16, dtype="float32")
    out = []
    for model in (plain, fused):
        pages = KVPages(geometry, 2, torch.device("cpu"))
        pos = torch.arange(20)
        meta = AttentionMetadata(kv_pages=pages, seqs=[SeqSpan(q_start=0, q_len=20, ctx_len=20, block_ids=torch.arange(2))],
                                 slot_block_ids=pos // 16, slot_offsets=pos % 16)
        with torch.inference_mode(), attention_context(meta):
            out.append(model.compute_logits(model(ids, pos)))
    torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)


# ---- row invariance: an argument of the step ---------------------------------------------------


def _source_nodes(path: Path):
    return ast.walk(ast.parse(path.read_text(), filename=str(path)))


def test_no_forward_is_rebound_and_no_gemm_switch_is_global_anywhere_in_the_engine():
    """No module of the engine rebinds a forward with types.MethodType, and the GEMM and fused
    modules keep no `global` state a step could leave behind."""
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for node in _source_nodes(path):
            if isinstance(node, ast.Attribute) and node.attr == "MethodType":
                offenders.append(f"{path.name}:{node.lineno} MethodType")
    for name in ("kernels/row_invariant_gemm.py", "kernels/gemv.py", "models/fused_ops.py", "models/fast_paths.py",
                 "models/cpu_fused.py", "models/cpu_gemm.py", "models/layers.py"):
        for node in _source_nodes(ENGINE / name):
            if isinstance(node, ast.Global):
                offenders.append(f"{name}:{node.lineno} global {', '.join(node.names)}")
    assert offenders == []


@pytest.fixture
def cuda_modules(monkeypatch):
    """row_invariant_gemm and fused_ops, imported with a stand-in for triton where it is missing
    (only their Python routing runs here: the Triton GEMM is replaced by a recorder), and
    forgotten afterwards so no other test sees them."""
    before = set(sys.modules)
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = types.ModuleType("triton")
        stub.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        stub.cdiv = lambda a, b: -(-a // b)
        stub.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
        stub.__version__ = "0"
        stub.language = types.ModuleType("triton.language")
        stub.language.constexpr = object
        monkeypatch.setitem(sys.modules, "triton", stub)
        monkeypatch.setitem(sys.modules, "triton.language", stub.language)
    from kvtool.engine.kernels import row_invariant_gemm
    from kvtool.engine.models import fused_ops

    routes: list[str] = []
    monkeypatch.setattr(row_invariant_gemm, "triton_mm", lambda a, w, config=None: routes.append("invariant") or a @ w.T)
    yield row_invariant_gemm, fused_ops, routes
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def _meta(row_invariant: bool) -> AttentionMetadata:
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=16, block_size=16, dtype="float32")
    return AttentionMetadata(kv_pages=KVPages(geometry, 1, torch.device("cpu")), seqs=[], slot_block_ids=None,
                             slot_offsets=None, row_invariant=row_invariant)


def test_two_engines_interleaving_steps_keep_their_own_row_invariance(cuda_modules):
    """A batch-invariant engine's steps and a default one's, interleaved in one process: each
    step's projections (read from its metadata) and logits (an argument) take that step's route."""
    rig, fused_ops, routes = cuda_modules
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen)
    proj = nn.Linear(8, 6, bias=False)
    proj.weight.data.copy_(w)
    head = fused_ops.LogitsProduct(w)
    engines = {"invariant": True, "default": False}
    for step in range(2):
        for name, invariant in engines.items():
            routes.clear()
            with attention_context(_meta(invariant)):
                projected = fused_ops._project_out(proj, x)
            logits = head(x, invariant)
            assert routes == (["invariant", "invariant"] if invariant else []), (step, name)
            torch.testing.assert_close(projected, F.linear(x, w))
            torch.testing.assert_close(logits, F.linear(x, w))
    assert {"_enabled", "row_invariant_gemms"}.isdisjoint(vars(rig))  # the old process-wide switch


def test_a_narrow_weight_splits_its_k_by_its_shape_alone(cuda_modules):
    """`k_split` gives the narrow projections of the presets (Qwen3-0.6B's o_proj and down_proj)
    equal parts of K, each a multiple of 16 columns and at least SPLIT_MIN_PART, and leaves wider
    ones (the 4096-wide models' projections, gate/up, the LM heads) and tiny ones (a MoE router)
    whole; `linear` keeps a split weight off cuBLAS at every row count."""
    rig, _, routes = cuda_modules
    split = {(4096, 1024): 1, (1024, 2048): 4, (6144, 1024): 1, (1024, 3072): 6,  # Qwen3-0.6B
             (6144, 4096): 1, (4096, 4096): 1, (24576, 4096): 1, (4096, 12288): 1,  # Qwen3-8B
             (4096, 2560): 1, (2560, 2048): 1,  # Gemma 3 4B
             (2048, 8192): 4, (151936, 1024): 1, (151936, 4096): 1, (128, 2048): 1}
    assert {shape: rig.k_split(*shape) for shape in split} == split
    for (n, k), parts in split.items():
        assert k % parts == 0 and (k // parts) % 16 == 0
        assert parts == 1 or k // parts >= rig.SPLIT_MIN_PART
    x = torch.randn(rig.CUBLAS_MIN_ROWS, 2048)
    for n, route in ((1024, ["invariant"]), (8192, [])):  # split, not split
        routes.clear()
        y = rig.linear(x, torch.randn(n, 2048), row_invariant=True)
        assert routes == route and y.shape == (rig.CUBLAS_MIN_ROWS, n)


def test_the_warm_up_reaches_every_split_launch(cuda_modules):
    """The runner's warm-up row counts compile every (tiles, split, parts in programs of their own
    or not) launch below cuBLAS's rows, and up to WARM_UP_MAX_ROWS for a split weight only."""
    rig, _, _ = cuda_modules
    unsplit = {(6144, 1024), (24576, 4096)}
    qwen3_06b = {(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)}
    assert max(rig.warm_up_rows(unsplit, 132)) < rig.CUBLAS_MIN_ROWS
    rows = rig.warm_up_rows(qwen3_06b, 132)
    assert max(rows) >= rig.CUBLAS_MIN_ROWS

    def launches(r):
        return {(n, k, rig.config_for(r, n, 132, k), r <= rig.SPLIT_PARALLEL_ROWS) for n, k in qwen3_06b
                if r < rig.CUBLAS_MIN_ROWS or rig.k_split(n, k) > 1}

    reached = set().union(*(launches(r) for r in rows))
    assert reached == set().union(*(launches(r) for r in range(1, 4 * rig.WARM_UP_MAX_ROWS)))


@pytest.mark.parametrize("programs", [0, 512])
def test_an_fp8_weight_spreads_its_k_by_its_shape_alone(cuda_modules, monkeypatch, programs):
    """FP8 `k_split`: by default (SPLIT_PROGRAMS 0) no weight spreads its K. With SPLIT_PROGRAMS
    512, the projections of a block-wise FP8 Qwen3-8B whose column tiles leave a decode step with
    few programs (q/k/v, o_proj, down_proj) spread each tile's K groups over programs of whole
    128-column groups, at least SPLIT_MIN_PART wide; gate/up stays in one. Either way the warm-up
    rows reach every (tiles, parts, activations quantised inside) launch `fp8_mm` makes."""
    from kvtool.engine.kernels import fp8_gemm

    assert fp8_gemm.SPLIT_PROGRAMS == 0
    monkeypatch.setattr(fp8_gemm, "SPLIT_PROGRAMS", programs)
    split = {(6144, 4096): 2, (4096, 4096): 4, (24576, 4096): 1, (4096, 12288): 4,  # Qwen3-8B
             (4096, 1024): 1, (384, 200): 1, (1000, 640): 1}
    if not programs:
        split = dict.fromkeys(split, 1)
    assert {shape: fp8_gemm.k_split(*shape) for shape in split} == split
    for (n, k), parts in split.items():
        assert parts == 1 or (k % (fp8_gemm.GROUP * parts) == 0 and k // parts >= fp8_gemm.SPLIT_MIN_PART)

    def launches(rows):
        out = set()
        for n, k in split:
            parts = fp8_gemm.k_split(n, k) if rows <= fp8_gemm.SPLIT_PARALLEL_ROWS else 1
            out.add((fp8_gemm.config_for(rows, n, 132, k), parts, rows <= fp8_gemm.FUSED_QUANTIZE_ROWS and parts == 1))
        return out

    reached = set().union(*(launches(r) for r in fp8_gemm.WARM_UP_ROWS))
    assert reached == set().union(*(launches(r) for r in range(1, 4096)))
