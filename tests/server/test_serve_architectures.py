"""`kvtool serve DIR` on every supported architecture's test preset, answering the official
`openai` client with the tokens the engine gives in-process for the same chat (greedy)."""

import openai
import pytest

from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.catalog import create_model_dir
from tests.support.server_process import ServerProcess

# The test preset of each architecture beside the tiny Qwen3 and Llama ones the other serve tests
# use, and the FP8 checkpoint.
PRESETS = ["tiny-qwen2", "tiny-mistral", "phi-3-tiny", "tiny-mixtral", "tiny-qwen3-moe", "tiny-fp8", "tiny-gemma3",
           "tiny-gemma2"]
FLAGS = ["--device", "cpu", "--kv-cache-memory", "64M", "--max-model-len", "1024"]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 8


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_serve_answers_the_openai_client_with_the_engines_tokens(tmp_path, preset):
    model = tmp_path / preset
    create_model_dir(model, preset=preset, seed=3)
    engine = LLMEngine(EngineParams(model=str(model), device="cpu", kv_cache_memory=64 << 20, max_model_len=1024))
    try:
        prompt = engine.encode_prompt(QUESTION, chat=True)
        expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    finally:
        engine.close()
    with ServerProcess(["--model", str(model), "--served-model-name", preset, *FLAGS]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=preset, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=MAX_TOKENS, temperature=0.0)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == len(prompt)
    assert choice.message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.output_token_ids)
