"""Two `kvtool serve` replicas behind vLLM's router (`vllm-router`) with its cache-aware policy.

The cache-aware policy keeps, per worker, a prefix tree of the request texts it sent there: a
request whose text mostly matches a worker's tree goes to that worker, any other to the least
loaded one. The workload opens a long stream with prefix A (so its replica is busy), then sends
prefix B (it lands on the other, idle replica), then more requests with each prefix: each must
land where its prefix is cached, which the replicas' own /metrics show (prefix-cache hit tokens
and requests per replica), and every output must be the one a single replica gives.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router_process import RouterProcess
from tests.server_process import ServerProcess

MODEL = "tiny"
PREFIX_A = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
PREFIX_B = "Lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor. " * 4
ROUNDS = 3


def _serve_flags(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--served-model-name", MODEL, "--device", "cpu", "--kv-cache-memory", "64M"]


def _complete(client: openai.OpenAI, prompt: str) -> tuple[str, int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _counts(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return m["kvtool:requests_total"], m["kvtool:prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    with ServerProcess(_serve_flags(tiny_model_dir)) as a, ServerProcess(_serve_flags(tiny_model_dir)) as b:
        yield a, b


def test_shared_prefixes_land_where_they_are_cached(replicas, tiny_model_dir):
    a, b = replicas
    prompts = [(p, p + f"Question {i}: what comes next?") for i in range(1, ROUNDS + 1) for p in (PREFIX_A, PREFIX_B)]
    with ServerProcess(_serve_flags(tiny_model_dir)) as single:
        reference = {prompt: _complete(openai.OpenAI(base_url=single.base_url, api_key="unused"), prompt)[0]
                     for _, prompt in prompts}

    before = {s.url: _counts(s) for s in replicas}
    with RouterProcess([a.url, b.url], policy="cache_aware") as router:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        # A long stream with prefix A keeps its replica loaded while prefix B is routed: B's text
        # matches no tree, so it goes to the least loaded replica, the other one.
        stream = client.completions.create(model=MODEL, prompt=PREFIX_A + "Question 0:", max_tokens=2000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        first_b = _complete(client, PREFIX_B + "Question 0:")
        stream.close()
        results = {prompt: _complete(client, prompt) for _, prompt in prompts}

    assert first_b[1] == 0
    for prompt, (text, cached) in results.items():
        assert text == reference[prompt], prompt
        assert cached >= 16 * (min(len(PREFIX_A), len(PREFIX_B)) // 16 - 1), (prompt, cached)
    hits_a = sum(cached for (prefix, prompt) in prompts if prefix == PREFIX_A for cached in [results[prompt][1]])
    hits_b = sum(cached for (prefix, prompt) in prompts if prefix == PREFIX_B for cached in [results[prompt][1]])
    after = {s.url: _counts(s) for s in replicas}
    delta = {url: (after[url][0] - before[url][0], after[url][1] - before[url][1]) for url in after}
    # Each replica served one prefix: the stream (or B's first request) plus ROUNDS requests,
    # and all of its hit tokens are that prefix's.
    assert sorted(delta.values()) == sorted([(ROUNDS + 1.0, float(hits_a)), (ROUNDS + 1.0, float(hits_b))]), delta
    assert hits_a != hits_b


def test_worker_routes_the_router_uses(replicas):
    a, _ = replicas
    tok = httpx.post(f"{a.url}/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0 and tok["token_strs"] is None
    chat = httpx.post(f"{a.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "return_token_strs": True}, timeout=30).json()
    assert len(chat["token_strs"]) == chat["count"] > tok["count"]
    back = httpx.post(f"{a.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert back == {"prompt": "hello"}
    wrong = httpx.post(f"{a.url}/tokenize", json={"model": "other", "prompt": "hello"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"

    # The router's own defaults for fields kvtool does not take are accepted; other values are not.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0, "no_stop_trim": False,
            "skip_special_tokens": True, "return_hidden_states": False}
    plain = httpx.post(f"{a.url}/v1/completions", json={k: body[k] for k in ("model", "prompt", "max_tokens", "temperature")},
                       timeout=60).json()
    assert httpx.post(f"{a.url}/v1/completions", json=body, timeout=60).json()["choices"] == plain["choices"]
    refused = httpx.post(f"{a.url}/v1/completions", json={**body, "no_stop_trim": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_stop_trim"
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                 "continue_final_message": False, "separate_reasoning": True, "include_reasoning": True}
    assert httpx.post(f"{a.url}/v1/chat/completions", json=chat_body, timeout=60).status_code == 200
