"""`kvtool serve` as a real subprocess, driven by the official `openai` client (and raw HTTP for errors).

One tiny-model server is shared by the module; tests that need other flags (a failing
connector, a server to stop, the default model) start their own.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import kvtool_cmd
from tests.support.server_process import REPO_ROOT, ServerProcess


API_KEY = "test-key-1"
MODEL = "tiny"
MAX_MODEL_LEN = 256
ENGINE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32"]
PROMPTS = ["The capital of France is", "Hello, my name is", "1, 2, 3, 4,"]
MAX_TOKENS = 8
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def _generate_runs(tiny_model_dir):
    """`kvtool generate --json` on the same model and engine flags, greedy: started here, so that
    they run while the server starts, and read by `reference`."""
    runs = {}
    for kind in ("completion", "chat"):
        cmd = [*kvtool_cmd(), "generate", "--model", str(tiny_model_dir), *ENGINE_FLAGS, "--json",
               "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
        for p in PROMPTS:
            cmd += ["--prompt", p]
        if kind == "chat":
            cmd.append("--chat")
        runs[kind] = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(_generate_runs) -> dict[str, list[dict]]:
    out = {}
    for kind, proc in _generate_runs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[kind] = json.loads(stdout)["requests"]
    return out


@pytest.fixture(scope="module")
def server(tiny_model_dir, _generate_runs):
    flags = ["--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-key", API_KEY,
             "--enable-prefix-caching", *ENGINE_FLAGS]
    with ServerProcess(flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def _check_usage(usage, num_prompt: int, num_output: int) -> None:
    assert usage.prompt_tokens == num_prompt
    assert usage.completion_tokens == num_output
    assert usage.total_tokens == num_prompt + num_output
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens >= 0


def _post(server, path: str, body, *, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if isinstance(body, (bytes, str)):
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60, **kw)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str)
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def _sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


# ---- basics ------------------------------------------------------------------------------------


def test_health_models_and_metrics(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert _extra(models.data[0], "max_model_len") == MAX_MODEL_LEN
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in ("kvtool:requests_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "kvtool:connector_loaded_tokens_total", "vllm:kv_offload_load_bytes_total",
                 "kvtool:connector_load_failures_total", "vllm:time_to_first_token_seconds_bucket"):
        assert name in metrics.text


# ---- same tokens as `kvtool generate` ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_match_generate(client, reference, stream):
    for prompt, ref in zip(PROMPTS, reference["completion"]):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"return_token_ids": True})
        if not stream:
            r = client.completions.create(**kw)
            choice = r.choices[0]
            assert _extra(choice, "token_ids") == ref["output_token_ids"]
            assert _extra(choice, "prompt_token_ids") == ref["prompt_token_ids"]
            assert choice.text == ref["text"]
            assert choice.finish_reason == ref["finish_reason"]
            _check_usage(r.usage, len(ref["prompt_token_ids"]), len(ref["output_token_ids"]))
        else:
            ids, text, finish, usage = [], "", None, None
            for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids += _extra(c, "token_ids") or []
                    text += c.text
                    finish = c.finish_reason or finish
            assert ids == ref["output_token_ids"]
            assert text == ref["text"]
            assert finish == ref["finish_reason"]
            _check_usage(usage, len(ref["prompt_token_ids"]), len(ref["output_token_ids"]))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_matches_generate(client, reference, stream):
    for prompt, ref in zip(PROMPTS, reference["chat"]):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                  temperature=0, extra_body={"return_token_ids": True})
        if not stream:
            r = client.chat.completions.create(**kw)
            assert _extra(r, "prompt_token_ids") == ref["prompt_token_ids"]
            assert _extra(r.choices[0], "token_ids") == ref["output_token_ids"]
            assert r.choices[0].message.role == "assistant"
            assert r.choices[0].message.content == ref["text"]
            _check_usage(r.usage, len(ref["prompt_token_ids"]), len(ref["output_token_ids"]))
        else:
            ids, text, roles, finish, usage = [], "", [], None, None
            for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids += _extra(c, "token_ids") or []
                    text += c.delta.content or ""
                    roles += [c.delta.role] if c.delta.role else []
                    finish = c.finish_reason or finish
            assert roles == ["assistant"]
            assert ids == ref["output_token_ids"]
            assert text == ref["text"]
            assert finish == ref["finish_reason"]
            _check_usage(usage, len(ref["prompt_token_ids"]), len(ref["output_token_ids"]))


def test_token_id_prompt_and_sampling_fields(client, reference):
    ref = reference["completion"][0]
    r = client.completions.create(model=MODEL, prompt=ref["prompt_token_ids"], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert _extra(r.choices[0], "token_ids") == ref["output_token_ids"]
    # stop_token_ids ends the choice at the first match, which is reported as stop_reason.
    stop_at = ref["output_token_ids"][2]
    first = ref["output_token_ids"].index(stop_at)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"return_token_ids": True, "stop_token_ids": [stop_at], "ignore_eos": True,
                                              "top_k": 5, "cache_salt": "salt-a", "kv_transfer_params": {}})
    assert _extra(r.choices[0], "token_ids") == ref["output_token_ids"][: first + 1]
    assert r.choices[0].finish_reason == "stop"
    assert _extra(r.choices[0], "stop_reason") == stop_at
    # Seeded sampling repeats itself.
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0.9, top_p=0.9, seed=1234,
              extra_body={"return_token_ids": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert _extra(a.choices[0], "token_ids") == _extra(b.choices[0], "token_ids")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_cuts_text(client, reference, stream):
    # Text from a stop string on is never sent, even in a stream that saw it arrive piece by piece.
    prompt, ref_text = next((p, r["text"]) for p, r in zip(PROMPTS, reference["completion"]) if len(r["text"]) >= 4)
    stop = ref_text[2:4]
    expected = ref_text[: ref_text.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "never-seen"])
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        text, finish, stop_reason = choice.text, choice.finish_reason, _extra(choice, "stop_reason")
    else:
        text, finish, stop_reason = "", None, None
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
                stop_reason = _extra(c, "stop_reason") or stop_reason
    assert (text, finish, stop_reason) == (expected, "stop", stop)


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


# ---- continuous batching across HTTP requests --------------------------------------------------


def test_32_concurrent_streams_equal_each_alone(server, client):
    cases = [(f"req {i}: " + "abcdefgh"[i % 8] * (3 + 7 * i), 4 + (i % 5) * 5) for i in range(32)]
    alone = []
    for prompt, n in cases:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"return_token_ids": True})
        alone.append((_extra(r.choices[0], "token_ids"), r.choices[0].text))

    async def one(aclient, prompt: str, n: int):
        ids, text = [], ""
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                                  extra_body={"return_token_ids": True})
        async for chunk in stream:
            for c in chunk.choices:
                ids += _extra(c, "token_ids") or []
                text += c.text
        return ids, text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in cases))

    before = server.metrics()
    together = asyncio.run(all_at_once())
    assert together == alone
    assert server.metrics()["kvtool:requests_total"] - before["kvtool:requests_total"] == len(cases)


# ---- errors ------------------------------------------------------------------------------------

_TOO_LONG = "x" * (MAX_MODEL_LEN + 10)

ERROR_CASES = {
    "unknown-model": ("/completions", {"model": "nope", "prompt": "hi"}, API_KEY, 400, "model"),
    "negative-max-tokens": ("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, API_KEY, 400, "max_tokens"),
    "prompt-too-long": ("/completions", {"model": MODEL, "prompt": _TOO_LONG}, API_KEY, 400, None),
    "prompt-too-long-stream": ("/completions", {"model": MODEL, "prompt": _TOO_LONG, "stream": True}, API_KEY, 400, None),
    "chat-too-long": ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": _TOO_LONG}]},
                      API_KEY, 400, None),
    "token-id-out-of-range": ("/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, API_KEY, 400, None),
    "malformed-json": ("/completions", b'{"model": "tiny", "prompt": ', API_KEY, 400, None),
    "not-an-object": ("/chat/completions", b"[1, 2]", API_KEY, 400, None),
    "n-too-many": ("/completions", {"model": MODEL, "prompt": "hi", "n": 65}, API_KEY, 400, "n"),
    "unknown-field": ("/completions", {"model": MODEL, "prompt": "hi", "bogus": 1}, API_KEY, 400, "bogus"),
    "wrong-key": ("/completions", {"model": MODEL, "prompt": "hi"}, "wrong-key", 401, None),
    "missing-key": ("/completions", {"model": MODEL, "prompt": "hi"}, None, 401, None),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_then_next_request_succeeds(server, case):
    path, body, key, status, param = ERROR_CASES[case]
    _assert_error(_post(server, path, body, key=key), status, param)
    ok = _post(server, "/completions", {"model": MODEL, "prompt": "after an error", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed outside /v1


# ---- local prefix cache ------------------------------------------------------------------------


def test_repeated_prompt_hits_local_prefix_cache(server, client):
    prompt = f"prefix cache check {uuid.uuid4().hex} " + "lorem ipsum " * 6  # > 4 blocks of 16 tokens
    before = server.metrics()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Full blocks are hit; at least one token is always computed.
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    assert second.choices[0].text == first.choices[0].text
    after = server.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert hits == second.usage.prompt_tokens_details.cached_tokens
    assert queries == 2 * n


# ---- disconnects -------------------------------------------------------------------------------


def _wait_idle(server, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0 and m["kvtool:kv_cache_free_blocks"] == m["kvtool:kv_cache_blocks"]:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_client_disconnect_aborts_and_frees_blocks(server):
    aborted = 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"}'
    before = server.metrics().get(aborted, 0.0)
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.base_url}/completions", json={**body, "stream": True}, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    m = _wait_idle(server)
    assert m[aborted] == before + 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", json=body, headers=headers, timeout=0.3)
    m = _wait_idle(server)
    assert m[aborted] == before + 2


# ---- KV load failure under the `fail` policy ---------------------------------------------------

# The test-only dict connector, with every load finding its blocks gone from the store.
_FAILING_LOADS = (
    "import tests.support.connectors.dict_connector as d\n"
    "d.BEFORE_LOAD.append(lambda loads: d.STORE.clear() if loads else None)\n"
    "from kvtool.cli import main\n"
    "main()\n"
)
_DICT_CONNECTOR = json.dumps({
    "kv_connector": "DictConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
    "kv_connector_module_path": "tests.support.connectors.dict_connector",
})


@pytest.fixture(scope="module")
def failing_server(tiny_model_dir):
    import sys

    flags = ["--model", str(tiny_model_dir), "--served-model-name", MODEL, "--kv-transfer-config", _DICT_CONNECTOR,
             "--no-enable-prefix-caching", *ENGINE_FLAGS]
    with ServerProcess(flags, launcher=[sys.executable, "-c", _FAILING_LOADS, "serve"]) as s:
        yield s


def test_kv_load_failure_is_500_and_server_keeps_serving(failing_server):
    s = failing_server
    prompt = "kv load failure " + "z" * 40  # 3 full blocks: stored by the first request, loaded by the second
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    assert _post(s, "/completions", body, key=None).status_code == 200
    err = _assert_error(_post(s, "/completions", body, key=None), 500)
    assert err["type"] == "server_error" and err["code"] == "kv_load_failed" and "KV load failed" in err["message"]

    # Streaming: a final chunk with finish_reason "error", then an error event, then [DONE].
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "temperature": 0}
    assert _post(s, "/chat/completions", chat, key=None).status_code == 200
    with httpx.stream("POST", f"{s.base_url}/chat/completions", json={**chat, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    final, error = json.loads(events[-3]), json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "error"
    assert set(error) == {"error"} and error["error"]["code"] == "kv_load_failed"

    ok = _post(s, "/completions", {**body, "prompt": "a different prompt " + "q" * 40}, key=None)
    assert ok.status_code == 200, ok.text
    assert s.metrics()["kvtool:connector_load_failures_total"] == 2
    assert s.metrics()["kvtool:connector_stored_tokens_total"] > 0


# ---- shutdown ----------------------------------------------------------------------------------


def test_sigterm_during_stream_ends_process_quickly(tiny_model_dir):
    with ServerProcess(["--model", str(tiny_model_dir)]) as s:
        status, elapsed, events = _sigterm_during_stream(s, tiny_model_dir)
        logs = s.logs()
    assert status in (0, -signal.SIGTERM)
    assert elapsed < 8, f"shutdown took {elapsed:.1f} s"
    # The stream was aborted after the grace period and still ended properly.
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert "Application shutdown complete" in logs


def _sigterm_during_stream(s: ServerProcess, tiny_model_dir) -> tuple[int, float, list[str]]:
    events: list[str] = []
    first = threading.Event()

    def read_stream():
        body = {"model": str(tiny_model_dir), "prompt": "go on", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{s.base_url}/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first.set()
        except httpx.HTTPError:
            pass
        first.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    try:
        assert first.wait(60)
        t0 = time.monotonic()
        status = s.stop(signal.SIGTERM, timeout_s=20)
        elapsed = time.monotonic() - t0
    finally:
        reader.join(30)
    return status, elapsed, events


# ---- the embedded default model ----------------------------------------------------------------


def test_no_arguments_serves_default_model_that_knows_paris():
    with ServerProcess([], startup_timeout_s=900) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
    assert "Paris" in r.choices[0].message.content
