"""Our models (Qwen3, Llama, Phi-3, Mixtral, Qwen3-MoE) against Hugging Face transformers (the reference) on the same
directory, float32 on CPU.

For each model, with its modules' own forwards, with the CPU fused forwards over F.linear, and
over oneDNN (as the runner runs them): a 64-token prefill, then 32 greedy decode steps, through real KVPages and
attention metadata; the logits at all 96 positions must be within 1e-4 of transformers' logits for
the same tokens, and transformers' argmax must pick the same greedy tokens.
"""

from __future__ import annotations


import msgspec
import pytest
import torch

from kvtool.engine.models import build_model
from kvtool.engine.models.cpu_fused import fuse_cpu_modules
from kvtool.engine.models.fast_paths import apply_fast_paths
from kvtool.engine.models.model_dir import open_model_dir
from kvtool.engine.models.rope import rope_frequencies
from kvtool.engine.presets.catalog import write_random_model_dir
from tests.support.paged_sequence import PagedSequence, greedy_run

NUM_PROMPT_TOKENS = 64
NUM_DECODE_STEPS = 32
# float32 logits; transformers multiplies other shapes, whose BLAS kernels round differently by
# machine (up to about 1e-4 on the embedded model on AVX-512 and AMX CPUs).
ATOL = 2e-4
# The model's own forwards as `build_model` makes them, the CPU fused forwards over F.linear
# products, and over oneDNN-reordered weights as the runner runs them (`apply_fast_paths`).
PRODUCTS = ["reference", "dense", "onednn"]


def hf_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for one sequence. Returns [len(token_ids), V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


def check_against_hf(model_dir, prompt: list[int], products: str) -> None:
    md = open_model_dir(model_dir)
    ours = build_model(md, "cpu", torch.float32, "auto")
    if products == "dense":
        fuse_cpu_modules(ours)
    elif products == "onednn":  # as the runner runs it
        # (a model whose modules the fused forwards are not written for runs its own: Gemma 3)
        assert (apply_fast_paths(ours, "cpu", torch.float32).packed_weights > 0) == ours.fused_forwards
    logits, generated = greedy_run(ours, md.config, prompt, NUM_DECODE_STEPS)
    ref = hf_logits(model_dir, prompt + generated)
    assert logits.shape == ref.shape == (len(prompt) + NUM_DECODE_STEPS, md.config.vocab_size)
    diff = (logits - ref).abs().amax(dim=-1)
    worst = int(diff.argmax())
    assert diff.max() <= ATOL, f"max abs diff {diff.max():.3g} at position {worst} (prefill < {len(prompt)})"
    # transformers' greedy choice after each position is the token we generated there.
    assert ref[len(prompt) - 1 : -1].argmax(dim=-1).tolist() == generated


MODEL_TYPES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama",
               "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16,
             "beta_slow": 2}
LINEAR_ROPE = {"rope_type": "linear", "factor": 3.0}
# head_dim 16: 8 factors each; the engine's length (512) exceeds 64, so the long ones are used.
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0]}
DYNAMIC_ROPE = {"rope_type": "dynamic", "factor": 2.0}


def config(arch: str, *, heads: int, kv_heads: int, tied: bool, form: str = "classic", hidden: int = 64,
           head_dim: int | None = None, rope: dict | None = None, bias: bool = False) -> dict:
    """A small config.json (2 layers); `form` picks classic (rope_theta/rope_scaling/torch_dtype) or
    transformers 5 (rope_parameters/dtype)."""
    cfg = {
        "architectures": [arch], "model_type": MODEL_TYPES[arch],
        "vocab_size": 384, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "tie_word_embeddings": tied, "attention_bias": bias,
        "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 258,
    }
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        cfg["sliding_window"] = None
    if arch == "Qwen2ForCausalLM":
        del cfg["attention_bias"]
    if head_dim is not None or arch.startswith("Qwen3"):
        cfg["head_dim"] = head_dim or hidden // heads
    if form == "classic":
        cfg.update(rope_theta=10000.0, rope_scaling=rope, torch_dtype="float32")
    else:
        cfg.update(rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, dtype="float32")
    return cfg


def phi3_config(*, heads: int, kv_heads: int, form: str = "classic", **extra) -> dict:
    """A small Phi3ForCausalLM config.json (2 layers, head_dim 96, untied, Phi-3's keys)."""
    cfg = config("LlamaForCausalLM", heads=heads, kv_heads=kv_heads, tied=False, hidden=96 * heads, form=form)
    del cfg["attention_bias"]
    return {**cfg, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "intermediate_size": 160 * heads,
            "rms_norm_eps": 1e-5, "original_max_position_embeddings": 512, "pad_token_id": 256, **extra}


def moe_config(arch: str, *, experts: int, top_k: int, form: str = "classic", **extra) -> dict:
    """A small MoE config.json (2 layers, 4 heads over 2 KV heads, untied): Mixtral's experts have
    intermediate_size rows, Qwen3-MoE's moe_intermediate_size (its dense layers intermediate_size)."""
    cfg = config(arch, heads=4, kv_heads=2, tied=False, form=form)
    if arch == "MixtralForCausalLM":
        del cfg["attention_bias"]
        return {**cfg, "num_local_experts": experts, "num_experts_per_tok": top_k, **extra}
    return {**cfg, "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": 48, **extra}


def gemma3_config(*, form: str = "classic", **extra) -> dict:
    """A small Gemma3ForCausalLM config.json (4 layers, 4 heads over 2 KV heads, head_dim 32, tied):
    every other layer local with a 24-token window, the global ones with linear RoPE scaling."""
    cfg = config("Gemma3ForCausalLM", heads=4, kv_heads=2, tied=True, head_dim=32, form=form,
                 rope=LINEAR_ROPE if form == "classic" else None)
    del cfg["hidden_act"]
    cfg.update(num_hidden_layers=4, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
               sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0)
    if form == "classic":
        cfg["rope_local_base_freq"] = 5000.0
    else:
        cfg["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 20000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}
    return {**cfg, **extra}


def gemma2_config(**extra) -> dict:
    """A small Gemma2ForCausalLM config.json (4 layers alternating local and global, a 24-token
    window, head_dim 32, tied), its attention and final logits soft-capped (small caps that bind)."""
    cfg = config("Gemma2ForCausalLM", heads=4, kv_heads=2, tied=True, head_dim=32)
    del cfg["hidden_act"]
    cfg.update(num_hidden_layers=4, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
               sliding_window=24, attn_logit_softcapping=3.0, final_logit_softcapping=4.0, pad_token_id=0)
    return {**cfg, **extra}


RANDOM_CONFIGS = {
    # head_dim 32 while hidden / heads is 16: Qwen3's own head_dim; q/k/v/o biases.
    "qwen3-gqa1-tied-bias": config("Qwen3ForCausalLM", heads=4, kv_heads=4, tied=True, head_dim=32, bias=True),
    "qwen3-gqa2-untied-v5": config("Qwen3ForCausalLM", heads=4, kv_heads=2, tied=False, form="v5"),
    "llama-gqa4-untied-llama3": config("LlamaForCausalLM", heads=8, kv_heads=2, tied=False, rope=LLAMA3_ROPE),
    "llama-gqa2-tied-llama3-v5": config("LlamaForCausalLM", heads=6, kv_heads=3, tied=True, hidden=96,
                                        form="v5", rope=LLAMA3_ROPE),
    "llama-gqa1-tied-bias": config("LlamaForCausalLM", heads=4, kv_heads=4, tied=True, head_dim=16, bias=True),
    # Qwen2: q/k/v biases, none on o_proj (its config has no attention_bias key).
    "qwen2-gqa2-tied": config("Qwen2ForCausalLM", heads=4, kv_heads=2, tied=True),
    "qwen2-gqa4-untied-yarn-v5": config("Qwen2ForCausalLM", heads=8, kv_heads=2, tied=False, form="v5", rope=YARN_ROPE),
    "mistral-gqa2-untied-linear": config("MistralForCausalLM", heads=4, kv_heads=2, tied=False, rope=LINEAR_ROPE),
    "mistral-gqa2-untied-longrope-v5": config("MistralForCausalLM", heads=4, kv_heads=2, tied=False, form="v5",
                                              rope=LONGROPE),
    "qwen2-gqa2-tied-dynamic": config("Qwen2ForCausalLM", heads=4, kv_heads=2, tied=True, rope=DYNAMIC_ROPE),
    # Phi-3: q/k/v and gate/up stored fused (split as they load), head_dim 96 as Phi-3-mini's,
    # a window that does not bind at these lengths; Phi-3-medium's grouped KV heads in the other.
    "phi3-gqa1-untied-window": phi3_config(heads=2, kv_heads=2, sliding_window=511),
    "phi3-gqa2-untied-v5": phi3_config(heads=4, kv_heads=2, form="v5"),
    # Phi-3.5's long-context RoPE: 48 short and long factors for head_dim 96.
    "phi3-gqa2-untied-longrope": phi3_config(heads=4, kv_heads=2, rope_scaling={
        "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(48)],
        "long_factor": [1.0 + 0.2 * i for i in range(48)]}),
    # MoE: Mixtral renormalises its top-k weights; Qwen3-MoE with norm_topk_prob and a dense
    # layer (mlp_only_layers), and without renormalisation, every other layer sparse.
    "mixtral-8e-top2-v5": moe_config("MixtralForCausalLM", experts=8, top_k=2, form="v5"),
    "qwen3moe-6e-top2-norm-dense1": moe_config("Qwen3MoeForCausalLM", experts=6, top_k=2, norm_topk_prob=True,
                                               mlp_only_layers=[1]),
    "qwen3moe-8e-top3-step2-v5": moe_config("Qwen3MoeForCausalLM", experts=8, top_k=3, form="v5",
                                            decoder_sparse_step=2),
    # Sliding windows far shorter than the 96 positions: each query sees its last 24 (or 40) keys.
    "mistral-gqa2-window24": {**config("MistralForCausalLM", heads=4, kv_heads=2, tied=False), "sliding_window": 24},
    "mixtral-8e-top2-window40": moe_config("MixtralForCausalLM", experts=8, top_k=2, sliding_window=40),
    "phi3-gqa2-window24-v5": phi3_config(heads=4, kv_heads=2, form="v5", sliding_window=24),
    # Gemma 3: (1 + w) norms around attention and MLP, q/k norms, a scaled embedding, GeGLU,
    # local and global layers with their own RoPE; the second with a final logit soft cap.
    "gemma3-local-global": gemma3_config(),
    "gemma2-softcaps": gemma2_config(),
    "gemma2-gqa1-defaults-v5": {**{k: v for k, v in gemma2_config().items()
                                   if k not in ("attn_logit_softcapping", "final_logit_softcapping", "rope_theta",
                                                "rope_scaling", "torch_dtype")},
                                "num_key_value_heads": 4, "dtype": "float32"},
    "gemma3-pattern3-softcap-v5": {**{k: v for k, v in gemma3_config(form="v5").items() if k != "layer_types"},
                                   "num_hidden_layers": 6, "sliding_window_pattern": 3, "final_logit_softcapping": 5.0},
}


@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_random_config_matches_transformers(tmp_path, name, products):
    d = tmp_path / name
    # One model is stored sharded (model.safetensors.index.json), as large checkpoints are.
    shard_bytes = 64_000 if name == "llama-gqa4-untied-llama3" else 1 << 30
    cfg = write_random_model_dir(d, RANDOM_CONFIGS[name], seed=11, max_shard_bytes=shard_bytes)
    assert (d / "model.safetensors.index.json").is_file() == (shard_bytes < 1 << 30)
    if cfg.rope_scaling is not None:
        # The scaled frequencies must differ from plain RoPE for this test to prove anything.
        plain = msgspec.structs.replace(cfg, rope_scaling=None)
        # (dynamic is plain up to max_position_embeddings, the longest sequence the engine runs)
        if cfg.rope_scaling["rope_type"] != "dynamic":
            assert not torch.equal(rope_frequencies(cfg)[0], rope_frequencies(plain)[0])
    g = torch.Generator().manual_seed(len(name))
    prompt = torch.randint(0, 259, (NUM_PROMPT_TOKENS,), generator=g).tolist()
    check_against_hf(d, prompt, products)


@pytest.fixture(scope="module")
def smollm2_dir():
    from kvtool.engine.presets.default_model import ensure_default_model

    return ensure_default_model()


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PASSAGE = (
    "The Loire is the longest river in France. It rises in the southeastern quarter of the Massif "
    "Central and flows north through Nevers to Orleans, then west through Tours and Nantes until it "
    "reaches the Bay of Biscay at Saint-Nazaire. Its valley is famous for its chateaux and vineyards."
)


@pytest.mark.parametrize("products", PRODUCTS)
def test_smollm2_matches_transformers(smollm2_dir, products):
    tok = open_model_dir(smollm2_dir).tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PASSAGE}]), add_special_tokens=False)
    assert len(prompt) >= NUM_PROMPT_TOKENS
    check_against_hf(smollm2_dir, prompt[:NUM_PROMPT_TOKENS], products)


def test_smollm2_answers_the_capital_of_france(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    md = open_model_dir(smollm2_dir)
    text = md.tokenizer.apply_chat_template(QUESTION)
    prompt = md.tokenizer.encode(text, add_special_tokens=False)
    hf_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert hf_tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True) == text
    assert hf_tok(text, add_special_tokens=False).input_ids == prompt

    ours = build_model(md, "cpu", torch.float32)
    seq = PagedSequence(ours, md.config, len(prompt) + 16)
    logits = seq.step(prompt)
    answer: list[int] = []
    while len(answer) < 16:
        answer.append(int(logits[-1].argmax()))
        if answer[-1] in md.config.eos_token_ids:
            break
        logits = seq.step([answer[-1]])
    assert md.tokenizer.decode(answer) == "The capital of France is Paris."

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert out[0, len(prompt):].tolist() == answer
