"""RoPE frequencies and attention factors (`models/rope.py`) against transformers' own functions.

For every RoPE type, both config.json forms and several sequence lengths: inv_freq equals
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[type]`'s to float32 rounding, the attention
factor is the same number, and our RotaryEmbedding's cos/sin equal transformers' Llama rotary
embedding's (which scales them by the attention factor) for the positions of one such forward.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.engine.models.layers import RotaryEmbedding
from kvtool.engine.models.model_dir import parse_config
from kvtool.engine.models.rope import rope_frequencies

HEAD_DIM = 32
MAX_POSITIONS = 4096
SHORT = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
LONG = [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)]

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                               "beta_fast": 24, "beta_slow": 2, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 1024,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                              "attention_factor": 1.25},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024, "short_factor": SHORT,
                 "long_factor": LONG},
    "longrope-factor": {"rope_type": "longrope", "original_max_position_embeddings": 1024, "factor": 2.0,
                        "short_factor": SHORT, "long_factor": LONG},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
}
SEQ_LENS = [None, 100, 1024, 1025, 3000, MAX_POSITIONS]


def raw_config(scaling: dict | None, form: str) -> dict:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": HEAD_DIM, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-6}
    if form == "classic":
        raw.update(rope_theta=50000.0, rope_scaling=scaling)
    else:
        raw.update(rope_parameters={"rope_theta": 50000.0, **(scaling or {"rope_type": "default"})})
    return raw


def hf_config(raw: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("form", ["classic", "v5"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_match_transformers(name, form):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = raw_config(SCALINGS[name], form)
    ours = parse_config(raw)
    hf = hf_config(raw)
    init = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]] if SCALINGS[name] else None
    for seq_len in SEQ_LENS:
        inv_freq, factor = rope_frequencies(ours, seq_len)
        if init is None:
            want = 1.0 / (50000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
            want_factor = 1.0
        else:
            # Our None is max_position_embeddings (transformers' None is longrope's short factors).
            want, want_factor = init(hf, "cpu", seq_len=seq_len or MAX_POSITIONS)
        assert inv_freq.dtype == torch.float32 and inv_freq.shape == (HEAD_DIM // 2,)
        torch.testing.assert_close(inv_freq, want.float(), rtol=1e-6, atol=0, msg=f"seq_len {seq_len}")
        assert factor == pytest.approx(want_factor, rel=1e-12), seq_len


def test_both_forms_parse_alike():
    for scaling in SCALINGS.values():
        assert parse_config(raw_config(scaling, "classic")) == parse_config(raw_config(scaling, "v5"))


def test_longrope_picks_its_factors_by_length():
    cfg = parse_config(raw_config(SCALINGS["longrope"], "classic"))
    short, _ = rope_frequencies(cfg, 1024)
    long, factor = rope_frequencies(cfg, 1025)
    assert not torch.equal(short, long)
    assert torch.equal(long, rope_frequencies(cfg)[0])  # max_position_embeddings 4096 > 1024
    assert factor > 1.0


@pytest.mark.parametrize("name", ["yarn", "yarn-mscale", "longrope", "dynamic", "linear"])
def test_cos_sin_match_transformers_rotary_embedding(name):
    """cos/sin of one forward of `length` tokens: transformers' rotary embedding (attention factor
    applied, longrope and dynamic picked by the forward's length) and ours built for that length."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = raw_config(SCALINGS[name], "classic")
    ours_cfg, hf = parse_config(raw), hf_config(raw)
    for length in (700, 2000):
        positions = torch.arange(length)
        want_cos, want_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None])
        ours = RotaryEmbedding(ours_cfg, seq_len=length)
        cos, sin = ours(positions, torch.float32)
        torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=2e-6)
        torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=2e-6)
