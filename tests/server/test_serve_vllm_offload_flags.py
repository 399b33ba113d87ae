"""A vLLM offload command line runs unchanged on `kvtool serve`: the shortcut flags
(`--kv-offloading-size`, `--kv-offloading-backend`), the dotted `--kv-transfer-config.KEY VALUE`
form with a bare size, and `POST /reset_prefix_cache` between runs, as benchmark scripts call it."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.support.server_process import ServerProcess

PROMPT_IDS = [(i * 37) % 240 + 5 for i in range(300)]
HIT_TOKENS = 288  # whole 16-token blocks before the prompt's last token
BASE = ["--device", "cpu", "--kv-cache-memory", "64M"]

COMMAND_LINES = {
    "shortcut": ["--kv-offloading-size", "0.05", "--kv-offloading-backend", "native"],
    "dotted": ["--kv_transfer_config.kv_connector", "OffloadingConnector",
               "--kv-transfer-config.kv_role=kv_both",
               "--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use", "50M"],
}


def complete(client, model: str, max_tokens: int = 6):
    return client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=max_tokens, temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def reset(server, **query) -> httpx.Response:
    return httpx.post(f"{server.url}/reset_prefix_cache", params=query, timeout=60)


@pytest.mark.parametrize("form", sorted(COMMAND_LINES))
def test_vllm_offload_command_line_stores_and_reuses(form, tiny_model_dir):
    model = str(tiny_model_dir)
    # vLLM's shape: the model positionally, then its flags.
    with ServerProcess([model, *BASE, *COMMAND_LINES[form]]) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
        first = complete(client, model)
        again = complete(client, model)  # the device prefix cache serves it
        r = reset(srv)
        assert r.status_code == 200 and r.json() == {"success": True}
        from_tier = complete(client, model)  # the device cache is empty: the CPU tier serves it
        m = srv.metrics()
        # reset_external also empties the CPU tier: nothing serves the prompt any more.
        r = reset(srv, reset_external="true")
        assert r.status_code == 200 and r.json() == {"success": True}
        cold = complete(client, model)
        after = srv.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == HIT_TOKENS
    assert from_tier.usage.prompt_tokens_details.cached_tokens == HIT_TOKENS
    assert m["vllm:external_prefix_cache_hits_total"] == HIT_TOKENS
    assert m["kvtool:connector_loaded_tokens_total"] == HIT_TOKENS
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert after["vllm:external_prefix_cache_hits_total"] == HIT_TOKENS
    texts = {c.choices[0].text for c in (first, again, from_tier, cold)}
    assert len(texts) == 1


def test_reset_while_a_request_runs(tiny_model_dir):
    model = str(tiny_model_dir)
    with ServerProcess([model, *BASE]) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
        reference = complete(client, model, max_tokens=1500).choices[0].token_ids
        answers: list[httpx.Response] = []
        stream = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=1500, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        token_ids: list[int] = []
        finish = None
        for chunk in stream:
            token_ids += chunk.choices[0].token_ids or []
            finish = chunk.choices[0].finish_reason or finish
            if len(answers) == 0 and token_ids:
                # The request holds blocks: vLLM's answer is 200 with success false.
                answers.append(reset(srv))
                # Preempting the running request first lets the reset through; the request goes on.
                answers.append(reset(srv, reset_running_requests="true"))
        bad = reset(srv, reset_external="maybe")
        assert [a.status_code for a in answers] == [200, 200]
        assert [a.json() for a in answers] == [{"success": False}, {"success": True}]
        assert finish == "length" and token_ids == reference
        assert bad.status_code == 400 and "\n" not in bad.json()["error"]["message"]
        assert srv.metrics()["vllm:num_preemptions_total"] == 1
        assert reset(srv).json() == {"success": True}  # idle again


def test_concurrent_resets_all_answer(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), *BASE]) as srv:
        answers: list[int] = []
        threads = [threading.Thread(target=lambda: answers.append(reset(srv).status_code)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [200] * 8
