"""Model presets and `create_model_dir`: write a real Hugging Face directory that transformers loads too.

Presets:

    tiny                    Qwen3, ~3.3M parameters, 512-id vocabulary: tests and CPU smoke runs
    tiny-fp8                the tiny preset as a block-wise FP8 checkpoint (float8_e4m3fn
                            projections, [128, 128] blocks, float32 weight_scale_inv)
    tiny-qwen2, tiny-mistral  the same scale in Qwen2's and Mistral's shapes (tests)
    tiny-qwen3-moe, tiny-mixtral  MoE at that scale: 4 experts, top-2 (tests)
    qwen3-0.6b, qwen3-8b    the public Qwen3 config.json values, random weights
    qwen3-8b-fp8            Qwen3-8B's config with the block-wise FP8 quantization_config of
                            Qwen's FP8 releases (config-only: dummy weights are dense)
    qwen2.5-0.5b, qwen2.5-7b  the public Qwen2.5 Instruct config.json values, random weights
    llama-3.1-8b            the public Llama-3.1-8B-Instruct config.json values, random weights
    mistral-7b              the public Mistral-7B-Instruct-v0.3 config.json values, random weights
    qwen3-30b-a3b           the public Qwen3-30B-A3B config.json values, random weights
    mixtral-8x7b            the public Mixtral-8x7B-Instruct-v0.1 config.json values, random weights
    phi-3-mini              the public Phi-3-mini-4k-instruct config.json values, random weights
    phi-3-tiny              Phi-3's shapes (head_dim 96, as many KV heads as heads, fused
                            qkv_proj/gate_up_proj, its 2047-token window) at ~2M parameters
    smollm2-135m-instruct   the real SmolLM2-135M-Instruct, converted from the embedded GGUF

The random presets ship a byte-level tokenizer built with the `tokenizers` library: one id per
byte (ids 0..255), so any text round-trips, plus the family's special tokens at their real ids
(ChatML for Qwen, Llama 3's header/eot tokens, Mistral's <s>, </s>, [INST], [/INST]; Mistral's
sit below the bytes, which then start at id 8; Phi-3's <|user|>/<|end|> tokens, its <s> at id 1
left out, that id being a byte). The config keeps the real vocab_size, so the ids
between 256 and the special tokens exist in the embedding but never come out of encode (they
decode to nothing). The 8B presets are meant for `--load-format dummy` on a GPU: with
--config-only only config.json, generation_config.json and the tokenizer files are written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from kvtool.engine.errors import ConfigError, ModelError
from kvtool.engine.kv.dtypes import canonical_dtype
from kvtool.engine.models.model_dir import INDEX_FILE, ModelConfig, make_temp_dir_beside, parse_config
from kvtool.engine.models.tokenizer import CHATML_TEMPLATE

Progress = Callable[[str, float], None]

DEFAULT_MAX_SHARD_BYTES = 2 << 30

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


class TokenizerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The byte-level tokenizer of a random preset: special tokens at fixed ids, and a chat template."""

    special_tokens: dict[str, int]
    bos_token: str | None
    eos_token: str
    pad_token: str | None = None
    # Prepend bos_token on encode(add_special_tokens=True), as Llama 3's tokenizer does.
    add_bos: bool = False
    # The id of byte 0 (bytes take ids byte_offset .. byte_offset + 255).
    byte_offset: int = 0
    chat_template: str = CHATML_TEMPLATE


class Preset(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    description: str
    hf_config: dict[str, Any]  # config.json as written (classic form)
    generation_config: dict[str, Any]
    tokenizer: TokenizerSpec


class CreatedModel(msgspec.Struct, frozen=True, kw_only=True):
    """What `create_model_dir` wrote."""

    path: str
    preset: str
    architecture: str
    num_parameters: int
    num_bytes: int  # all files of the directory
    files: list[str]
    seed: int | None  # None for real weights
    config_only: bool


CHATML_SMALL = TokenizerSpec(
    special_tokens={"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258},
    bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
)
_CHATML_QWEN3 = TokenizerSpec(
    special_tokens={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
)
_LLAMA3 = TokenizerSpec(
    special_tokens={
        "<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
    },
    bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos=True, chat_template=LLAMA3_TEMPLATE,
)

_PHI3 = TokenizerSpec(
    special_tokens={"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|system|>": 32006, "<|end|>": 32007,
                    "<|user|>": 32010},
    bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=PHI3_TEMPLATE,
)
_PHI3_SMALL = TokenizerSpec(
    special_tokens={"<|endoftext|>": 256, "<|assistant|>": 257, "<|system|>": 258, "<|end|>": 259, "<|user|>": 260},
    bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=PHI3_TEMPLATE,
)


def _phi3_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000,
        "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32064, **sizes,
    }


MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
_MISTRAL = TokenizerSpec(
    special_tokens={"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4},
    bos_token="<s>", eos_token="</s>", add_bos=True, byte_offset=8, chat_template=MISTRAL_TEMPLATE,
)


GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_GEMMA3 = TokenizerSpec(
    special_tokens={"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106},
    bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>", add_bos=True, byte_offset=256,
    chat_template=GEMMA_TEMPLATE,
)
_GEMMA2 = TokenizerSpec(
    special_tokens={"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 106, "<end_of_turn>": 107},
    bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>", add_bos=True, byte_offset=256,
    chat_template=GEMMA_TEMPLATE,
)
_GEMMA3_SMALL = TokenizerSpec(
    special_tokens={"<pad>": 256, "<eos>": 257, "<bos>": 258, "<start_of_turn>": 259, "<end_of_turn>": 260},
    bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>", add_bos=True, chat_template=GEMMA_TEMPLATE,
)


def _gemma3_config(**sizes: Any) -> dict[str, Any]:
    """Gemma-3-4b-it's text config (transformers' Gemma3TextConfig keys), sizes overridable."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 10240, "max_position_embeddings": 131072,
        "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0, "sliding_window": 1024,
        "sliding_window_pattern": 6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 262208, **sizes,
    }


def _gemma2_config(**sizes: Any) -> dict[str, Any]:
    """Gemma-2-9b-it's config (transformers' Gemma2Config keys), sizes overridable."""
    return {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": [1, 107],
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 256000, **sizes,
    }


def _qwen2_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936, **sizes,
    }


def _mistral_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32768, **sizes,
    }


def _mixtral_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000, **sizes,
    }


def _qwen3_moe_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, **sizes,
    }


def _qwen3_config(**sizes: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
        **sizes,
    }


# quantization_config of the block-wise FP8 checkpoints DeepSeek and Qwen release.
FP8_BLOCK_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}
_TINY_QWEN3 = _qwen3_config(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_window_layers=4, max_position_embeddings=4096,
    tie_word_embeddings=True, vocab_size=512, bos_token_id=256, eos_token_id=258, torch_dtype="float32",
)
_QWEN3_8B = _qwen3_config(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, max_window_layers=36, tie_word_embeddings=False,
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="Qwen3 architecture, ~3.3M random parameters, byte-level tokenizer",
        hf_config=_TINY_QWEN3,
        generation_config={"bos_token_id": 256, "eos_token_id": [258, 256]},
        tokenizer=CHATML_SMALL,
    ),
    "tiny-fp8": Preset(
        name="tiny-fp8",
        description="the tiny preset as a block-wise FP8 checkpoint ([128, 128] blocks), byte-level tokenizer",
        hf_config={**_TINY_QWEN3, "quantization_config": FP8_BLOCK_QUANTIZATION},
        generation_config={"bos_token_id": 256, "eos_token_id": [258, 256]},
        tokenizer=CHATML_SMALL,
    ),
    "qwen3-0.6b": Preset(
        name="qwen3-0.6b",
        description="Qwen3-0.6B's public config, random weights",
        hf_config=_qwen3_config(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, max_window_layers=28, tie_word_embeddings=True,
        ),
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "qwen3-8b": Preset(
        name="qwen3-8b",
        description="Qwen3-8B's public config, random weights (use --config-only and --load-format dummy)",
        hf_config=_QWEN3_8B,
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "qwen3-8b-fp8": Preset(
        name="qwen3-8b-fp8",
        description="Qwen3-8B's config as a block-wise FP8 checkpoint (use --config-only and --load-format dummy)",
        hf_config={**_QWEN3_8B, "quantization_config": FP8_BLOCK_QUANTIZATION},
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "tiny-qwen2": Preset(
        name="tiny-qwen2",
        description="Qwen2 architecture (q/k/v biases, tied head) at the tiny preset's scale, byte-level tokenizer",
        hf_config=_qwen2_config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_window_layers=4, max_position_embeddings=4096, sliding_window=4096,
            tie_word_embeddings=True, vocab_size=512, bos_token_id=256, eos_token_id=258, torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 256, "eos_token_id": [258, 256]},
        tokenizer=CHATML_SMALL,
    ),
    "tiny-mistral": Preset(
        name="tiny-mistral",
        description="Mistral architecture (untied head) at the tiny preset's scale, byte-level tokenizer",
        hf_config=_mistral_config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, vocab_size=512,
            torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        tokenizer=_MISTRAL,
    ),
    "tiny-qwen3-moe": Preset(
        name="tiny-qwen3-moe",
        description="Qwen3-MoE architecture (4 experts, top-2, a dense last layer) at the tiny preset's scale",
        hf_config=_qwen3_moe_config(
            hidden_size=256, intermediate_size=512, moe_intermediate_size=192, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[3], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_window_layers=4, max_position_embeddings=4096, vocab_size=512, bos_token_id=256,
            eos_token_id=258, torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 256, "eos_token_id": [258, 256]},
        tokenizer=CHATML_SMALL,
    ),
    "tiny-mixtral": Preset(
        name="tiny-mixtral",
        description="Mixtral architecture (4 experts, top-2) at the tiny preset's scale, byte-level tokenizer",
        hf_config=_mixtral_config(
            hidden_size=256, intermediate_size=384, num_local_experts=4, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, vocab_size=512,
            torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        tokenizer=_MISTRAL,
    ),
    "qwen3-30b-a3b": Preset(
        name="qwen3-30b-a3b",
        description="Qwen3-30B-A3B's public config, random weights (use --config-only and --load-format dummy)",
        hf_config=_qwen3_moe_config(),
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "mixtral-8x7b": Preset(
        name="mixtral-8x7b",
        description="Mixtral-8x7B-Instruct-v0.1's public config, random weights (use --config-only and --load-format dummy)",
        hf_config=_mixtral_config(),
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        tokenizer=_MISTRAL,
    ),
    "qwen2.5-0.5b": Preset(
        name="qwen2.5-0.5b",
        description="Qwen2.5-0.5B-Instruct's public config, random weights",
        hf_config=_qwen2_config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_window_layers=21, tie_word_embeddings=True,
        ),
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "qwen2.5-7b": Preset(
        name="qwen2.5-7b",
        description="Qwen2.5-7B-Instruct's public config, random weights (use --config-only and --load-format dummy)",
        hf_config=_qwen2_config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, max_window_layers=28, sliding_window=131072, tie_word_embeddings=False,
            vocab_size=152064,
        ),
        generation_config={"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
        tokenizer=_CHATML_QWEN3,
    ),
    "mistral-7b": Preset(
        name="mistral-7b",
        description="Mistral-7B-Instruct-v0.3's public config, random weights (use --config-only and --load-format dummy)",
        hf_config=_mistral_config(),
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        tokenizer=_MISTRAL,
    ),
    "llama-3.1-8b": Preset(
        name="llama-3.1-8b",
        description="Llama-3.1-8B-Instruct's public config, random weights (use --config-only and --load-format dummy)",
        hf_config={
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
            "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
            "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": 128256,
        },
        generation_config={"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
        tokenizer=_LLAMA3,
    ),
    "phi-3-mini": Preset(
        name="phi-3-mini",
        description="Phi-3-mini-4k-instruct's public config (its 2047-token sliding window), random weights",
        hf_config=_phi3_config(),
        generation_config={"bos_token_id": 1, "eos_token_id": [32000, 32001, 32007], "pad_token_id": 32000},
        tokenizer=_PHI3,
    ),
    "tiny-gemma3": Preset(
        name="tiny-gemma3",
        description="Gemma 3 architecture (local layers with a 64-token window, 1 global in 3) at the tiny preset's scale",
        hf_config=_gemma3_config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, query_pre_attn_scalar=64, sliding_window=64, sliding_window_pattern=3,
            max_position_embeddings=4096, vocab_size=512, bos_token_id=258, eos_token_id=[257, 260], pad_token_id=256,
            torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 258, "eos_token_id": [257, 260], "pad_token_id": 256},
        tokenizer=_GEMMA3_SMALL,
    ),
    "tiny-gemma2": Preset(
        name="tiny-gemma2",
        description="Gemma 2 architecture (local and global layers alternating, soft caps) at the tiny preset's scale",
        hf_config=_gemma2_config(
            hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, query_pre_attn_scalar=64, sliding_window=64, max_position_embeddings=4096, vocab_size=512,
            bos_token_id=258, eos_token_id=[257, 260], pad_token_id=256, torch_dtype="float32",
        ),
        generation_config={"bos_token_id": 258, "eos_token_id": [257, 260], "pad_token_id": 256},
        tokenizer=_GEMMA3_SMALL,
    ),
    "gemma-2-9b": Preset(
        name="gemma-2-9b",
        description="Gemma-2-9b-it's config, random weights (use --config-only and --load-format dummy)",
        hf_config=_gemma2_config(),
        generation_config={"bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0},
        tokenizer=_GEMMA2,
    ),
    "gemma-3-4b": Preset(
        name="gemma-3-4b",
        description="Gemma-3-4b-it's text config, random weights (use --config-only and --load-format dummy)",
        hf_config=_gemma3_config(),
        generation_config={"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0},
        tokenizer=_GEMMA3,
    ),
    "phi-3-tiny": Preset(
        name="phi-3-tiny",
        description="Phi-3 architecture and shapes, ~2M random parameters, byte-level tokenizer",
        hf_config=_phi3_config(
            hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=512, bos_token_id=None, eos_token_id=256, pad_token_id=256,
            torch_dtype="float32",
        ),
        generation_config={"eos_token_id": [256, 257, 259], "pad_token_id": 256},
        tokenizer=_PHI3_SMALL,
    ),
}
DEFAULT_PRESET = "smollm2-135m-instruct"
PRESET_NAMES = (*PRESETS, DEFAULT_PRESET)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 byte values: what the ByteLevel pre-tokenizer emits.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_byte_level_tokenizer(spec: TokenizerSpec) -> tokenizers.Tokenizer:
    """A BPE tokenizer with no merges over the 256 byte symbols (ids 0..255) plus `spec`'s special tokens.

    Every string encodes to its UTF-8 bytes (special-token strings aside) and decodes back exactly.
    """
    vocab = {ch: b + spec.byte_offset for b, ch in _bytes_to_unicode().items()}
    vocab.update(spec.special_tokens)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    if spec.add_bos and spec.bos_token is not None:
        bos = (spec.bos_token, spec.special_tokens[spec.bos_token])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    return tok


def tokenizer_config_json(spec: TokenizerSpec, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json for a byte-level tokenizer, readable by transformers 4 and 5."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "pad_token": spec.pad_token,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        # Also in chat_template.jinja; transformers releases before 4.50 read only this key.
        "chat_template": spec.chat_template,
    }
    return {k: v for k, v in cfg.items() if v is not None}


def create_model_dir(
    dir: str | os.PathLike[str],
    preset: str,
    seed: int = 0,
    config_only: bool = False,
    progress: Progress | None = None,
) -> CreatedModel:
    """Write preset `preset` as a Hugging Face directory at `dir` (created; must be absent or empty).

    Random presets draw their weights from `seed` (the same values `--load-format dummy --seed N`
    makes on CPU, saved in the config's dtype). `smollm2-135m-instruct` copies the default model,
    converting it first if this user has not yet. The directory appears atomically: it is built
    beside `dir` and renamed into place. progress(stage, fraction) is called as work proceeds.
    Raises ConfigError for an unknown preset or a non-empty `dir`, ModelError when the default
    model cannot be had.
    """
    if preset not in PRESET_NAMES:
        raise ConfigError(f"unknown preset {preset!r} (choose from: {', '.join(PRESET_NAMES)})")
    target = Path(dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{target}: already exists and is not an empty directory")
    tmp = make_temp_dir_beside(target)
    try:
        if preset == DEFAULT_PRESET:
            _copy_default_model(tmp, config_only, progress)
            seed_used = None
        else:
            p = PRESETS[preset]
            write_random_model_dir(
                tmp, p.hf_config, seed=seed, tokenizer=p.tokenizer, generation_config=p.generation_config,
                config_only=config_only, progress=progress,
            )
            seed_used = None if config_only else seed
        if target.exists():
            target.rmdir()  # empty, checked above
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    config = parse_config(json.loads((target / "config.json").read_text()), where=target / "config.json")
    files = sorted(f.name for f in target.iterdir())
    return CreatedModel(
        path=str(target), preset=preset, architecture=config.architecture,
        num_parameters=count_parameters(config), num_bytes=sum((target / f).stat().st_size for f in files),
        files=files, seed=seed_used, config_only=config_only,
    )


def count_parameters(config: ModelConfig) -> int:
    """Number of distinct parameters (a tied output matrix counted once)."""
    from kvtool.engine.models import parameter_shapes

    return sum(_numel(shape) for shape in parameter_shapes(config).values())


def write_random_model_dir(
    dir: Path,
    hf_config: dict[str, Any],
    *,
    seed: int,
    tokenizer: TokenizerSpec = CHATML_SMALL,
    generation_config: dict[str, Any] | None = None,
    config_only: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Progress | None = None,
) -> ModelConfig:
    """Write config.json, generation_config.json, the byte-level tokenizer and random weights into `dir`.

    `hf_config` is written as given (either config form); weights come from
    `models.iter_checkpoint_tensors(config, "cpu", seed)` (`iter_dummy_tensors` under the names
    and packing a checkpoint of the architecture has) cast to the config's dtype, in shards of at
    most `max_shard_bytes` (several shards get a model.safetensors.index.json). With a
    quantization_config the projections it quantises are stored as FP8 checkpoints store them:
    float8_e4m3fn beside a float32 scale (`quantization.quantize`). Used by the
    presets and by tests that need small models of their own shape. Raises ModelError when the
    config is unsupported or its vocabulary cannot hold the tokenizer's ids.
    """
    import torch
    from safetensors.torch import save_file

    from kvtool.engine.kv.pages import DTYPES
    from kvtool.engine.models import checkpoint_shapes, iter_checkpoint_tensors
    from kvtool.engine.models.quantization import is_quantized_module, quantize, stored_scale_shape

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    config = parse_config(hf_config, generation_config, where=dir / "config.json")
    highest_id = max(*tokenizer.special_tokens.values(), 255 + tokenizer.byte_offset)
    if config.vocab_size <= highest_id:
        raise ModelError(f"{dir / 'config.json'}: vocab_size {config.vocab_size} cannot hold token id {highest_id}")

    (dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    gen = generation_config or {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    (dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    build_byte_level_tokenizer(tokenizer).save(str(dir / "tokenizer.json"))
    tok_cfg = tokenizer_config_json(tokenizer, config.max_position_embeddings)
    (dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (dir / "chat_template.jinja").write_text(tokenizer.chat_template)
    if config_only:
        return config

    dtype = DTYPES[canonical_dtype(config.torch_dtype)]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes = checkpoint_shapes(config)
    q = config.quantization
    fp8 = {name for name in shapes if q is not None and name.endswith(".weight")
           and is_quantized_module(q, name.removesuffix(".weight"))}

    def stored_bytes(name: str) -> int:  # an FP8 weight: one byte an element, and its float32 scale
        if name in fp8:
            return _numel(shapes[name]) + 4 * _numel(stored_scale_shape(q, shapes[name]))
        return itemsize * _numel(shapes[name])

    # Plan shards up front so file names can carry the shard count.
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name in shapes:
        nbytes = stored_bytes(name)
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    values = iter_checkpoint_tensors(config, "cpu", seed)
    weight_map: dict[str, str] = {}
    done = 0
    for file_name, members in zip(names, shards):
        tensors = {}
        for name in members:
            got_name, value = next(values)
            assert got_name == name  # one iteration order for plan and values
            if name in fp8:
                scale_name = f"{name.removesuffix('weight')}{q.scale_suffix}"
                tensors[name], tensors[scale_name] = quantize(value, q)
                weight_map[scale_name] = file_name
            else:
                tensors[name] = value.to(dtype)
            weight_map[name] = file_name
            done += 1
            if progress is not None:
                progress("random weights", done / len(shapes))
        save_file(tensors, str(dir / file_name), metadata={"format": "pt"})
        os.chmod(dir / file_name, 0o644)  # safetensors creates files private to the owner
    if len(shards) > 1:
        total = sum(stored_bytes(name) for name in shapes)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return config


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _copy_default_model(dest: Path, config_only: bool, progress: Progress | None) -> None:
    from kvtool.engine.presets.default_model import ensure_default_model

    src = ensure_default_model(progress=progress)
    for f in sorted(src.iterdir()):
        if config_only and f.name.endswith(".safetensors"):
            continue
        shutil.copy2(f, dest / f.name)
