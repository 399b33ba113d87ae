"""Phi3ForCausalLM: its config (its window, long-context RoPE refused in one line), its packed checkpoint (qkv_proj and gate_up_proj split as they load,
refused in one line when they do not fit), and the engine on the phi-3-tiny preset against
transformers (the reference, float32 on CPU): greedy tokens and log-probabilities through
chunked prefill and prefix hits, the OffloadingConnector's CPU + disk reuse in a second engine,
and two tensor-parallel ranks. The per-position logits of Phi-3 configs against transformers,
with every CPU product, are in test_logits_vs_hf.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ModelError
from kvtool.engine.models import build_model, checkpoint_shapes
from kvtool.engine.models.model_dir import open_model_dir, parse_config
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.catalog import PRESETS, count_parameters, create_model_dir

WINDOW = 2047  # the phi-3 presets' sliding_window, as Phi-3-mini-4k's config has it
NUM_NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
# float32 log-probabilities of the greedy tokens against transformers' (other GEMM shapes round
# differently, up to about 1e-4 on some CPUs); TP=2 against TP=1 likewise.
LOGPROB_ATOL = 2e-4
# Three prompts; the second begins with the first's 48 tokens (three 16-token blocks).
PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(61)],
    [(7 * i + 3) % 250 + 1 for i in range(48)] + [(13 * i) % 240 + 2 for i in range(39)],
    [(11 * i + 5) % 255 for i in range(23)],
]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3") / "phi-3-tiny"
    create_model_dir(path, preset="phi-3-tiny", seed=0)
    return path


def _params(model, **overrides) -> EngineParams:
    base = {"model": str(model), "device": "cpu", "kv_cache_memory": 64 << 20, "max_model_len": WINDOW}
    return EngineParams(**{**base, **overrides})


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# -- config ------------------------------------------------------------------------------------


def test_presets_have_phi3_mini_shapes():
    mini = parse_config(PRESETS["phi-3-mini"].hf_config)
    assert (mini.hidden_size, mini.num_layers, mini.num_heads, mini.num_kv_heads, mini.intermediate_size,
            mini.vocab_size, mini.head_dim, mini.sliding_window) == (3072, 32, 32, 32, 8192, 32064, 96, WINDOW)
    assert count_parameters(mini) == 3_821_079_552  # Phi-3-mini's published count
    shapes = checkpoint_shapes(mini)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (3 * 3072, 3072)
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 8192, 3072)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes
    tiny = parse_config(PRESETS["phi-3-tiny"].hf_config)
    assert (tiny.architecture, tiny.head_dim, tiny.num_kv_heads, tiny.sliding_window) == (
        "Phi3ForCausalLM", 96, tiny.num_heads, WINDOW)


def test_config_reads_phi3_defaults_and_its_long_context_rope():
    raw = dict(PRESETS["phi-3-tiny"].hf_config)
    del raw["rms_norm_eps"], raw["architectures"]
    cfg = parse_config(raw)  # architecture from model_type
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.rms_norm_eps == 1e-5  # Phi3Config's default
    assert parse_config({**raw, "sliding_window": None}).sliding_window is None
    assert parse_config({**raw, "sliding_window": 0}).sliding_window is None  # 0: none, as vLLM reads it
    factors = [1.0] * 48
    longrope = parse_config({**raw, "rope_scaling": {"type": "longrope", "short_factor": factors, "long_factor": factors}})
    assert longrope.rope_scaling["rope_type"] == "longrope"
    for scaling in ({"type": "su", "short_factor": factors, "long_factor": factors}, {"type": "linear", "factor": 2.0}):
        with pytest.raises(ModelError, match="Phi3ForCausalLM with '(su|linear)' RoPE is not supported") as e:
            parse_config({**raw, "rope_scaling": scaling})
        _one_line(e)


def test_packed_tensors_are_split_and_refused_when_wrong(phi3_dir, tmp_path):
    import shutil

    model = build_model(open_model_dir(phi3_dir), "cpu", torch.float32)
    stored = load_file(phi3_dir / "model.safetensors")
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, k, v = (t.clone() for t in stored["model.layers.1.self_attn.qkv_proj.weight"].split([192, 192, 192]))
    gate, up = stored["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    for param, want in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v), (mlp.gate_proj, gate),
                        (mlp.up_proj, up)):
        assert torch.equal(param.weight, want)

    d = tmp_path / "broken"
    shutil.copytree(phi3_dir, d)
    for change, match in (
        (lambda t: t.update({"model.layers.1.self_attn.qkv_proj.weight": q}),
         r"tensor 'model.layers.1.self_attn.qkv_proj.weight' has shape \[192, 192\], config.json implies \[576, 192\]"),
        (lambda t: t.pop("model.layers.0.mlp.gate_up_proj.weight"),
         "tensor 'model.layers.0.mlp.gate_up_proj.weight' .*is missing from the weights"),
        (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": k}),
         "holds 'model.layers.1.self_attn.k_proj.weight', which is also in|"
         "tensor 'model.layers.1.self_attn.k_proj.weight' is also in"),
    ):
        tensors = dict(stored)
        change(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelError, match=match) as e:
            build_model(open_model_dir(d), "cpu", torch.float32)
        _one_line(e)


# -- the engine against transformers -----------------------------------------------------------


def _transformers_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens after `prompt` and the log-probability of each."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                          eos_token_id=[], pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        logits = hf(out[:, :-1]).logits[0, len(prompt) - 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return tokens, [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def _chosen_logprobs(result) -> list[float]:
    return [lp[t] for lp, t in zip(result.logprobs, result.output_token_ids, strict=True)]


def test_greedy_tokens_match_transformers_through_chunked_prefill_and_prefix_hits(phi3_dir):
    # 32-token steps: every prompt but the last is prefilled in chunks, beside decodes.
    with LLMEngine(_params(phi3_dir, max_num_batched_tokens=32)) as engine:
        first = engine.generate([PROMPTS[0]], GREEDY)[0]
        rest = engine.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0]], GREEDY)
        engine.check_integrity()
    assert rest[0].stats.num_cached_tokens == 48  # the shared prefix
    assert rest[2].stats.num_cached_tokens == 48  # the first prompt's whole blocks, again
    assert rest[2].output_token_ids == first.output_token_ids
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32).eval()
    for prompt, result in zip(PROMPTS, [rest[2], rest[0], rest[1]]):
        tokens, logprobs = _transformers_greedy(hf, prompt)
        assert result.output_token_ids == tokens
        assert _chosen_logprobs(result) == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def test_offloading_reuse_equals_no_reuse_in_a_new_engine(phi3_dir, tmp_path):
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"num_cpu_blocks": 64, "root_dir": str(tmp_path / "tier")},
    }))
    with LLMEngine(_params(phi3_dir)) as engine:
        want = engine.generate(PROMPTS, GREEDY)
    with LLMEngine(_params(phi3_dir, kv_transfer_config=ktc)) as engine:
        stored = engine.generate(PROMPTS, GREEDY)
        engine.flush_connector()
    # A new engine: an empty CPU tier and prefix cache, so the hits come from the disk tier.
    with LLMEngine(_params(phi3_dir, kv_transfer_config=ktc)) as engine:
        loaded = engine.generate(PROMPTS, GREEDY)
    assert [r.stats.num_external_tokens for r in loaded] == [48, 80, 16]  # whole blocks, last token computed
    for got in (stored, loaded):
        for a, b in zip(got, want, strict=True):
            assert a.output_token_ids == b.output_token_ids
            assert a.logprobs == b.logprobs  # bit-identical, not close


def test_two_tensor_parallel_ranks_give_one_process_tokens(phi3_dir):
    # Each rank reads its query head's rows of q, k and v (and its half of gate and up) out of
    # the stored qkv_proj and gate_up_proj.
    with LLMEngine(_params(phi3_dir)) as engine:
        tp1 = engine.generate(PROMPTS, GREEDY)
    with LLMEngine(_params(phi3_dir, tensor_parallel_size=2)) as engine:
        tp2 = engine.generate(PROMPTS, GREEDY)
    for a, b in zip(tp1, tp2, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert _chosen_logprobs(b) == pytest.approx(_chosen_logprobs(a), abs=LOGPROB_ATOL)
