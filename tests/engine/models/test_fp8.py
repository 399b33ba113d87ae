"""FP8 checkpoints: quantization_config in both forms, one-line refusals, loading by dequantising,
tokens against transformers and against a dense reference, and the identity that keeps a dense
model's KV from an FP8 one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.identity_digest import make_identity_digest
from kvtool.engine.connectors.offloading.connector import disk_identity
from kvtool.engine.connectors.offloading.disk.tier_identity import identity_differences
from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ModelError
from kvtool.engine.kv.identity import identity_for_model
from kvtool.engine.models import build_model
from kvtool.engine.models.model_dir import open_model_dir, parse_config
from kvtool.engine.models.quantization import FP8_DTYPE, dequantize, identity_name
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.catalog import PRESETS, create_model_dir, write_random_model_dir
from tests.support.fp8_checkpoint import dense_copy

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
PROMPTS = [
    [(7 * i + 3) % 250 + 1 for i in range(61)],
    [(7 * i + 3) % 250 + 1 for i in range(48)] + [(13 * i) % 240 + 2 for i in range(39)],
]
# Compressed-tensors FP8 as llm-compressor writes it: per-channel weights, dynamic per-token activations.
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True,
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
}
REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    create_model_dir(root / "tiny", preset="tiny", seed=0)
    create_model_dir(root / "tiny-fp8", preset="tiny-fp8", seed=0)
    return root


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def _params(model, **overrides) -> EngineParams:
    return EngineParams(**{"model": str(model), "device": "cpu", "kv_cache_memory": 64 << 20, **overrides})


def _transformers_greedy(path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                          eos_token_id=[], pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -- config --------------------------------------------------------------------------------------


def test_both_forms_parse_into_the_identity_name():
    base = PRESETS["tiny"].hf_config
    block = parse_config(PRESETS["tiny-fp8"].hf_config).quantization
    assert (block.method, block.weight_block_size, block.scale_suffix) == ("fp8", (128, 128), "weight_scale_inv")
    assert identity_name(block) == "fp8:block128x128:dynamic"
    per_tensor = parse_config({**base, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                                               "modules_to_not_convert": ["lm_head"]}}).quantization
    assert identity_name(per_tensor) == "fp8:tensor-or-channel:static"
    assert per_tensor.not_quantized == ("lm_head",)
    ct = parse_config({**base, "quantization_config": COMPRESSED_TENSORS}).quantization
    assert identity_name(ct) == "compressed-tensors:fp8:channel:dynamic-token"
    assert ct.not_quantized == ("lm_head",)
    assert identity_name(parse_config(base).quantization) == "none"


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_other_methods_are_refused_in_one_line_naming_them(method):
    with pytest.raises(ModelError) as e:
        parse_config({**PRESETS["tiny"].hf_config, "quantization_config": REFUSED[method]}, where="config.json")
    msg = _one_line(e)
    assert f"quantization method {method!r} is not supported" in msg and "supported: fp8" in msg


@pytest.mark.parametrize(("change", "named"), [
    ({"format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group"}}}}, "type 'int'"),
    ({"config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "block"}}}},
     "weight strategy 'block'"),
])
def test_other_compressed_tensors_schemes_are_refused(change, named):
    with pytest.raises(ModelError) as e:
        parse_config({**PRESETS["tiny"].hf_config, "quantization_config": {**COMPRESSED_TENSORS, **change}})
    assert named in _one_line(e)


# -- loading -------------------------------------------------------------------------------------


def test_checkpoint_is_stored_as_fp8_and_loads_as_transformers_dequantises_it(dirs):
    with safe_open(str(dirs / "tiny-fp8" / "model.safetensors"), "pt") as f:
        q = f.get_slice("model.layers.0.self_attn.k_proj.weight")
        s = f.get_slice("model.layers.0.self_attn.k_proj.weight_scale_inv")
        assert (q.get_dtype(), q.get_shape(), s.get_dtype(), s.get_shape()) == ("F8_E4M3", [128, 256], "F32", [1, 2])
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dirs / "tiny-fp8", dtype=torch.float32)
    ours = build_model(open_model_dir(dirs / "tiny-fp8"), "cpu", torch.float32)
    theirs = hf.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs[name]), name


def test_greedy_tokens_equal_transformers_and_the_dense_checkpoint(dirs, tmp_path):
    with LLMEngine(_params(dirs / "tiny-fp8", max_num_batched_tokens=32)) as engine:
        fp8 = engine.generate(PROMPTS, GREEDY)
    dense_copy(dirs / "tiny-fp8", tmp_path / "dense")
    with LLMEngine(_params(tmp_path / "dense", max_num_batched_tokens=32)) as engine:
        dense = engine.generate(PROMPTS, GREEDY)
    for prompt, a, b in zip(PROMPTS, fp8, dense, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.logprobs == b.logprobs  # the same dense weights: the same bits
        assert a.output_token_ids == _transformers_greedy(dirs / "tiny-fp8", prompt)


def test_compressed_tensors_loads_as_its_dense_reference(tmp_path):
    # transformers reads compressed-tensors only through another package: the reference is the
    # dense checkpoint computed from the file in this test.
    config = {**PRESETS["tiny"].hf_config, "tie_word_embeddings": False, "quantization_config": COMPRESSED_TENSORS}
    write_random_model_dir(tmp_path / "ct", config, seed=1)
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.up_proj.weight_scale").get_shape() == [768, 1]
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"  # ignored
    dense_copy(tmp_path / "ct", tmp_path / "dense")
    with LLMEngine(_params(tmp_path / "ct")) as engine:
        ct = engine.generate(PROMPTS, GREEDY)
    for prompt, result in zip(PROMPTS, ct, strict=True):
        assert result.output_token_ids == _transformers_greedy(tmp_path / "dense", prompt)


@pytest.mark.parametrize("ct", [False, True], ids=["block", "compressed-tensors-channel"])
def test_fp8_projections_kept_as_stored_compute_the_dequantised_models_bits(tmp_path, monkeypatch, ct):
    # Where a GPU has FP8 tensor cores the projections stay FP8 (`Fp8Linear`); here the module's own
    # forward (dequantise, then the dense product) runs on the CPU in bf16, so its bits must be
    # those of the model whose weights were dequantised as they loaded.
    from kvtool.engine.models import fp8_linear
    from tests.support.paged_sequence import greedy_run

    path = tmp_path / "m"
    if ct:
        config = {**PRESETS["tiny"].hf_config, "tie_word_embeddings": False, "quantization_config": COMPRESSED_TENSORS}
        write_random_model_dir(path, config, seed=1)
    else:
        create_model_dir(path, preset="tiny-fp8", seed=0)
    md = open_model_dir(path)
    dense = build_model(md, "cpu", torch.bfloat16, "auto")
    monkeypatch.setattr(fp8_linear, "supported_device", lambda device: True)
    kept = build_model(md, "cpu", torch.bfloat16, "auto")
    fp8 = [m for m in kept.modules() if isinstance(m, fp8_linear.Fp8Linear)]
    assert len(fp8) == 7 * md.config.num_layers and all(m.weight.dtype == FP8_DTYPE for m in fp8)
    assert all(m.weight_scale.dim() == 2 and m.weight_scale.dtype == torch.float32 for m in fp8)
    prompt = PROMPTS[0]
    want = greedy_run(dense, md.config, prompt, 8)
    got = greedy_run(kept, md.config, prompt, 8)
    assert got[1] == want[1] and torch.equal(got[0], want[0])
    # Dummy weights are quantised as the checkpoint's scheme would store them.
    dummy = build_model(md.config, "cpu", torch.bfloat16, "dummy", seed=4)
    assert sum(isinstance(m, fp8_linear.Fp8Linear) for m in dummy.modules()) == len(fp8)


def _tamper(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: t.pop("model.layers.2.mlp.down_proj.weight_scale_inv"), "FP8 tensor 'model.layers.2.mlp.down_proj.weight' has no scale"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(6, 1)}),
     "'model.layers.0.mlp.up_proj.weight_scale_inv' has shape [6, 1], the weight's [768, 256] under "
     "fp8:block128x128:dynamic implies [6, 2]"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}),
     "unexpected tensor 'model.norm.weight_scale_inv' (its weight 'model.norm.weight' is not FP8)"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(FP8_DTYPE)}), "only linear weights may be"),
])
def test_damaged_fp8_checkpoints_are_refused_in_one_line(dirs, tmp_path, edit, named):
    path = tmp_path / "m"
    path.mkdir()
    for f in (dirs / "tiny-fp8").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    _tamper(path, edit)
    with pytest.raises(ModelError) as e:
        build_model(open_model_dir(path), "cpu", torch.float32)
    assert named in _one_line(e)


def test_fp8_weights_without_quantization_config_are_refused(dirs, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    for f in (dirs / "tiny").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    _tamper(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].to(FP8_DTYPE)}))
    with pytest.raises(ModelError) as e:
        build_model(open_model_dir(path), "cpu", torch.float32)
    assert "is FP8 but config.json has no quantization_config" in _one_line(e)


def test_dequantize_expands_blocks_over_ragged_edges():
    q = parse_config(PRESETS["tiny-fp8"].hf_config).quantization
    weight = torch.ones(130, 129).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = dequantize(weight, scale, q)
    assert got[127, 127] == 1 and got[127, 128] == 2 and got[128, 0] == 3 and got[129, 128] == 4


# -- identity --------------------------------------------------------------------------------------


def test_identity_records_the_quantization_and_every_connector_tells_them_apart(dirs):
    dense = identity_for_model(dirs / "tiny", _params(dirs / "tiny"))
    fp8 = identity_for_model(dirs / "tiny-fp8", _params(dirs / "tiny-fp8"))
    assert (dense.weight_quantization, fp8.weight_quantization) == ("none", "fp8:block128x128:dynamic")
    assert make_identity_digest(dense) != make_identity_digest(fp8)
    differs = {d.field for d in identity_differences(disk_identity(dense, 16), disk_identity(fp8, 16))}
    assert "weight_quantization" in differs


def test_disk_tier_blocks_of_the_dense_model_are_missed_by_the_fp8_one(dirs, tmp_path):
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"num_cpu_blocks": 64, "root_dir": str(tmp_path / "tier")},
    }))
    for model, want in (("tiny", [0, 0]), ("tiny-fp8", [0, 0]), ("tiny-fp8", [48, 80])):
        with LLMEngine(_params(dirs / model, kv_transfer_config=ktc)) as engine:
            results = engine.generate(PROMPTS, GREEDY)
            engine.flush_connector()
        assert [r.stats.num_external_tokens for r in results] == want, model


def test_config_only_8b_fp8_preset_has_the_block_scheme(tmp_path):
    create_model_dir(tmp_path / "m", preset="qwen3-8b-fp8", config_only=True)
    identity = identity_for_model(tmp_path / "m", _params(tmp_path / "m", load_format="dummy"))
    assert identity.weight_quantization == "fp8:block128x128:dynamic"
