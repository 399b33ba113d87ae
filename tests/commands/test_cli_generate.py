"""`kvtool generate` as a user runs it: JSON fields scripts rely on, and one-line errors for bad input."""

import json
import shutil
import subprocess

import pytest

from tests.conftest import kvtool_cmd


def run(args, env, timeout=300):
    return subprocess.run(kvtool_cmd() + args, env=env, capture_output=True, text=True, timeout=timeout)


def test_json_report_fields(tiny_model_dir, cli_env):
    out = run(["generate", "--model", str(tiny_model_dir), "--prompt", "hello there", "--prompt", "hello there",
               "--max-tokens", "4", "--ignore-eos", "--json", "--kv-cache-memory", "64M"], cli_env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["requests"]) == 2
    for r in doc["requests"]:
        for field in ("prompt_token_ids", "output_token_ids", "text", "finish_reason", "num_prompt_tokens",
                      "num_cached_tokens", "num_external_tokens", "ttft_s"):
            assert field in r
        assert len(r["output_token_ids"]) == 4 and r["finish_reason"] == "length"
    assert doc["requests"][0]["output_token_ids"] == doc["requests"][1]["output_token_ids"]


def _bad_dirs(tmp_path, tiny_model_dir):
    unsupported = tmp_path / "unsupported"
    shutil.copytree(tiny_model_dir, unsupported)
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (unsupported / "config.json").write_text(json.dumps(cfg))
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return unsupported, truncated


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing_dir", "not found"),
        ("unsupported", "MambaForCausalLM"),
        ("truncated", "model.safetensors"),
        ("too_long", "maximum model length"),
        ("empty", "empty"),
        ("negative", "max_tokens"),
        ("bad_config_json", "kv_role"),
    ],
)
def test_bad_input_one_line_error(case, needle, tiny_model_dir, run_kvtool, tmp_path):
    unsupported, truncated = _bad_dirs(tmp_path, tiny_model_dir)
    model = str(tiny_model_dir)
    args = ["--prompt", "hi"]
    if case == "missing_dir":
        model = str(tmp_path / "nope")
    elif case == "unsupported":
        model = str(unsupported)
    elif case == "truncated":
        model = str(truncated)
    elif case == "too_long":
        args = ["--prompt", "x" * 200, "--max-model-len", "64"]
    elif case == "empty":
        args = ["--prompt", ""]
    elif case == "negative":
        args = ["--prompt", "hi", "--max-tokens", "-3"]
    elif case == "bad_config_json":
        args = ["--prompt", "hi", "--kv-transfer-config", '{"kv_connector":"OffloadingConnector"}']
    code, stdout, stderr = run_kvtool(["generate", "--model", model, "--kv-cache-memory", "64M"] + args)
    assert code == 2, (code, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in stderr and stdout == ""


def test_bad_input_in_a_real_process(tmp_path, cli_env):
    out = run(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"], cli_env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: model directory not found: {tmp_path / 'nope'}"]


def test_default_model_answers_the_chat_question(run_kvtool):
    """No --model: the embedded SmolLM2-135M-Instruct, through its chat template, greedy."""
    code, stdout, stderr = run_kvtool(
        ["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "20", "--json"]
    )
    assert code == 0, stderr
    r = json.loads(stdout)["requests"][0]
    assert r["text"].strip() == "The capital of France is Paris."
    assert r["finish_reason"] == "stop"


ARCHITECTURE_PRESETS = ["tiny-qwen2", "tiny-mistral", "phi-3-tiny", "tiny-mixtral", "tiny-qwen3-moe", "tiny-fp8",
                        "tiny-gemma2", "tiny-gemma3"]


@pytest.mark.parametrize("preset", ARCHITECTURE_PRESETS)
def test_generate_runs_every_architecture_with_the_engines_tokens(preset, run_kvtool, tmp_path):
    """`kvtool generate --model DIR` on CPU for each supported architecture's test preset (and the
    FP8 checkpoint): the engine's greedy tokens for the chat question."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams, SamplingParams
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / preset
    create_model_dir(model, preset=preset, seed=4)
    code, stdout, stderr = run_kvtool(["generate", "--model", model, "--chat", "--prompt", "What is the capital of France?",
                                       "--max-tokens", "6", "--temperature", "0", "--kv-cache-memory", "64M",
                                       "--max-model-len", "1024", "--json"])
    assert code == 0, stderr
    got = json.loads(stdout)["requests"][0]
    with LLMEngine(EngineParams(model=str(model), device="cpu", kv_cache_memory=64 << 20, max_model_len=1024)) as engine:
        prompt = engine.encode_prompt("What is the capital of France?", chat=True)
        want = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert got["prompt_token_ids"] == prompt and got["output_token_ids"] == want.output_token_ids
