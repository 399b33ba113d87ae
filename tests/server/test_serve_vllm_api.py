"""`kvtool serve` as vLLM users drive it: the request parameters, structured outputs, the extra
endpoints, vLLM's metric names, and bad input that gets a 400 while the server keeps serving.

One tiny-model server (started with vLLM's command-line shape) is shared by the module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.support.server_process import ServerProcess

MODEL = "tiny"
API_KEY = "k-1"
MAX_MODEL_LEN = 256
DATA = Path(__file__).resolve().parents[1] / "data"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    gen_dir = tmp_path_factory.mktemp("genconfig")
    (gen_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    # vLLM's command-line shape: the model positionally, then vLLM's flag names.
    flags = [str(tiny_model_dir), "--api-key", API_KEY, "--served-model-name", MODEL,
             "--max-model-len", str(MAX_MODEL_LEN), "--chat-template", template,
             "--generation-config", str(gen_dir),
             "--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}',
             "--enable-log-requests"]
    with ServerProcess(flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def _assert_400(server, path: str, body: dict, param: str | None = None) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _assert_serving(client):
    out = client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
    assert len(out.choices) == 1


def test_requests_are_logged_when_asked(server, client):
    client.completions.create(model=MODEL, prompt="log me", max_tokens=1)
    assert "prompt tokens, sampling SamplingParams(" in server.logs()


def test_generation_config_dir_supplies_defaults_and_request_fields_override(client):
    # The config says greedy and 5 tokens; two unseeded requests then agree.
    a = client.completions.create(model=MODEL, prompt="Once upon")
    b = client.completions.create(model=MODEL, prompt="Once upon")
    assert a.usage.completion_tokens == 5 and a.choices[0].text == b.choices[0].text
    c = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert c.usage.completion_tokens == 3


def test_chat_template_flag_is_used(server):
    r = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    body = r.json()
    text = _post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert text == "[user] hi\n[assistant] "
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN


def test_version_and_models(server, client):
    assert httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    card = client.models.list().data[0]
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN


def test_n_with_a_seed_is_reproducible_and_children_differ(client):
    kwargs = dict(model=MODEL, prompt="The sky is", max_tokens=8, n=3, seed=11, temperature=1.0)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1  # child i samples with seed + i
    # Child 1 of seed 11 is the single request of seed 12.
    alone = client.completions.create(**{**kwargs, "n": 1, "seed": 12})
    assert alone.choices[0].text == texts[1]
    assert first.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once


def test_n_choices_share_the_prompt_through_the_prefix_cache(server, client):
    hits = "vllm:prefix_cache_hits_total"
    before = server.metrics()[hits]
    prompt = "a prompt that no other test sends, long enough for a few blocks of sixteen tokens"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=3, temperature=0)
    block = 16
    shared = (out.usage.prompt_tokens - 1) // block * block  # whole blocks before the last prompt token
    assert shared >= 4 * block
    assert server.metrics()[hits] - before == 2 * shared  # choices 1 and 2 reuse choice 0's blocks


def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(client):
    prompts = ["alpha", "beta gamma", "delta"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for i, p in enumerate(prompts):
        one = client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        assert batch.choices[i].text == one.choices[0].text


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0)
    assert out.choices[0].text == "Echo me" + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=3, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_streamed_n_and_prompt_lists_carry_every_choice(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, temperature=0, stream=True))
    text = {i: "" for i in range(4)}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.text
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, temperature=0)
    assert [text[i] for i in range(4)] == [c.text for c in batch.choices]
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2,
                                               max_tokens=3, stream=True))
    assert {c.index for ch in chat for c in ch.choices} == {0, 1}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The engine itself on the same model and flags: what the server must reproduce."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    with LLMEngine(EngineParams(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN)) as e:
        yield e


def _engine_ids(engine, prompt: str, **fields) -> list[int]:
    from kvtool.engine.params import SamplingParams

    sp = SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **fields})
    return engine.generate([engine.encode_prompt(prompt)], sp)[0].output_token_ids


PROMPT = "abab abab abab"
# (request fields, the engine's SamplingParams fields): each changes the greedy output of PROMPT.
PARAMETER_CASES = {
    "presence+frequency": ({"presence_penalty": 2.0, "frequency_penalty": 2.0},
                           {"presence_penalty": 2.0, "frequency_penalty": 2.0}),
    "repetition": ({"repetition_penalty": 5.0}, {"repetition_penalty": 5.0}),
    "logit_bias": ({"logit_bias": {"120": 8.0}}, {"logit_bias": {120: 8.0}}),
    "bad_words": (None, None),  # the greedy token's own text, filled in by the test
    "min_p+seed": ({"temperature": 1.0, "min_p": 0.2, "seed": 9}, {"temperature": 1.0, "min_p": 0.2, "seed": 9}),
    "top_k+seed": ({"temperature": 1.0, "top_k": 3, "seed": 9}, {"temperature": 1.0, "top_k": 3, "seed": 9}),
}


@pytest.mark.parametrize("case", list(PARAMETER_CASES))
def test_sampling_parameters_mean_what_the_engine_computes(client, engine, case):
    request_fields, engine_fields = PARAMETER_CASES[case]
    prompt = PROMPT
    if case == "bad_words":
        prompt = "1, 2, 3"  # its greedy token is a whole character (" "), which a bad word can name
        greedy = _engine_ids(engine, prompt, temperature=0.0)[0]
        word = engine.tokenizer.decode([greedy])
        from kvtool.server.sampling import bad_words_token_ids

        request_fields = {"bad_words": [word]}
        engine_fields = {"bad_words_token_ids": bad_words_token_ids(engine.tokenizer, [word])}
    engine_fields = {"temperature": 0.0, **engine_fields}
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **request_fields})
    got = out.choices[0].model_extra["token_ids"]
    assert got == _engine_ids(engine, prompt, **engine_fields)
    assert got != _engine_ids(engine, prompt, temperature=engine_fields["temperature"],
                              seed=engine_fields.get("seed")), "the parameter changed nothing"
    if case == "logit_bias":
        assert got.count(120) > 0
    if case == "bad_words":
        assert engine_fields["bad_words_token_ids"][0] == [greedy] and greedy not in got


def test_min_tokens_masks_eos_until_reached(client, engine):
    eos = engine.model_config.eos_token_ids[0]
    # A bias that makes EOS the greedy pick: without min_tokens the output is one token long.
    short = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                      logit_bias={str(eos): 100})
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    longer = client.completions.create(model=MODEL, prompt="x", max_tokens=6, temperature=0,
                                       logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert longer.usage.completion_tokens == 5 and longer.choices[0].finish_reason == "stop"


def test_json_schema_output_parses_and_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    for seed in (1, 2):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=150, seed=seed, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # The tiny random model rarely closes a string by itself: a bias on `"` and `}` lets it end,
    # and the grammar keeps the output a JSON object whatever the bias pushes towards.
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                         response_format={"type": "json_object"}, seed=4, temperature=1.0,
                                         logit_bias={"34": 8, "125": 8})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_guided_regex_choice_and_structured_outputs(client):
    out = client.completions.create(model=MODEL, prompt="code:", max_tokens=20, temperature=1.0, seed=5,
                                    extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    import re

    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out.choices[0].text)
    pick = client.completions.create(model=MODEL, prompt="yes or no:", max_tokens=10, temperature=1.0, seed=6,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert pick.choices[0].text in ("yes", "no")
    so = client.completions.create(model=MODEL, prompt="p", max_tokens=10, temperature=1.0, seed=7,
                                   extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert so.choices[0].text in ("red", "green")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 100, "max_tokens": 200}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    # This server runs without --enable-auto-tool-choice: tools (auto by default) and forced calls are refused.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {
        "a": list(range(70000))}}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "temperature": 3.0}, "temperature"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "("}, None),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": {"lmcache.tag.user": 5}}, "kv_transfer_params"),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": {"k": {"nested": 1}}}, "kv_transfer_params"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/v1/completions", {"prompt": "y" * 10**6}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 10**6}]}, "messages"),
])
def test_bad_input_is_a_400_in_openai_s_shape_and_the_server_keeps_serving(server, client, path, body, param):
    err = _assert_400(server, path, body, param)
    if body.get("max_tokens") == 100000:
        assert err["message"] == ("max_tokens=100000 cannot be greater than max_model_len=256. "
                                  "Please request fewer output tokens.")
    if body.get("tools") and param == "tool_choice":
        assert "requires --enable-auto-tool-choice and --tool-call-parser to be set" in err["message"]
    _assert_serving(client)


def _nested(levels: int, leaf: str = "1") -> str:
    return "[" * levels + leaf + "]" * levels


_CHAT = '"messages": [{"role": "user", "content": "x"}]'
DEEP_BODIES = {
    "kv_transfer_params": ("/v1/completions", '{"prompt": "x", "kv_transfer_params": {"a": %s}}' % _nested(5000)),
    "structured_outputs": ("/v1/completions", '{"prompt": "x", "structured_outputs": {"json": {"a": %s}}}' % _nested(3000)),
    "guided_json": ("/v1/completions", '{"prompt": "x", "guided_json": %s}' % json.dumps(_nested(3000))),
    "response_format": ("/v1/chat/completions", '{%s, "response_format": {"type": "json_schema", "json_schema": '
                        '{"name": "x", "schema": {"a": %s}}}}' % (_CHAT, _nested(3000))),
    "chat_template_kwargs": ("/v1/chat/completions", '{%s, "chat_template_kwargs": {"a": %s}}' % (_CHAT, _nested(5000))),
    "tools": ("/v1/chat/completions", '{%s, "tools": [{"type": "function", "function": {"name": "f", "parameters": '
              '{"a": %s}}}]}' % (_CHAT, _nested(5000))),
    "messages": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "extra": %s}]}' % _nested(5000)),
    "tool_calls": ("/v1/chat/completions", '{"messages": [{"role": "assistant", "tool_calls": [{"type": "function", '
                   '"function": {"name": "f", "arguments": %s}}]}]}' % json.dumps(_nested(5000))),
    "body": ("/v1/completions", _nested(100_000)),
}


@pytest.mark.parametrize("name", list(DEEP_BODIES))
def test_bodies_nested_thousands_deep_are_a_400_naming_the_field(server, client, name):
    path, body = DEEP_BODIES[name]
    r = httpx.post(f"{server.url}{path}", content=body, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error"
    assert "64 levels deep" in err["message"]
    assert err["param"] == {"tool_calls": "messages", "body": None}.get(name, name)
    _assert_serving(client)


def _exposition(server) -> dict[str, str]:
    """{metric family name: type} from /metrics."""
    types = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter" and name.endswith("_total"):
                name = name[: -len("_total")]
            types[name] = kind
    return types


def test_vllm_metric_names_types_and_labels(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=3)
    types = _exposition(server)
    for name, kind in {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter", "vllm:external_prefix_cache_queries": "counter",
        "vllm:external_prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter", "vllm:prompt_tokens_by_source": "counter",
        "vllm:request_success": "counter", "vllm:num_preemptions": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:kv_offload_load_bytes": "counter", "vllm:kv_offload_load_time": "counter",
        "vllm:kv_offload_store_bytes": "counter", "vllm:kv_offload_store_time": "counter",
        "vllm:kv_offload_cpu_cache_usage_perc": "gauge",
    }.items():
        assert types.get(name) == kind, (name, types.get(name))
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}' in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"}' in text
    assert not [n for n in types if not n.startswith(("vllm:", "kvtool:"))]


def test_every_metric_of_vllm_s_grafana_dashboard_exists_with_its_type(server):
    dashboard = json.loads((DATA / "vllm-grafana-metrics.json").read_text())
    types = _exposition(server)
    missing = {m["name"]: m["type"] for m in dashboard["metrics"] if types.get(m["name"]) != m["type"]}
    assert missing == {}


@pytest.mark.parametrize("stream", [False, True])
def test_inter_token_latency_is_one_observation_per_token_gap(server, client, stream):
    # vLLM observes the time between a request's consecutive outputs (one token each here), so a
    # request of N tokens adds N - 1 observations; the per-request mean adds one.
    itl, tpot = "vllm:inter_token_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count"
    before = server.metrics()
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=7,
                                         temperature=0, stream=stream, stream_options={"include_usage": True} if stream else None,
                                         extra_body={"ignore_eos": True})
    usage = [c.usage for c in out if c.usage][-1] if stream else out.usage
    assert usage.completion_tokens == 7
    after = server.metrics()
    assert after[itl] - before[itl] == 6
    assert after["vllm:time_per_output_token_seconds_count"] - before["vllm:time_per_output_token_seconds_count"] == 6
    assert after[tpot] - before[tpot] == 1


def test_offload_cpu_cache_usage_is_vllm_s_gauge_and_fullness_kvtool_s(server, client):
    prompt = "a long prompt for the CPU tier, " * 3  # several whole blocks of sixteen tokens to store
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f'vllm:kv_offload_cpu_cache_usage_perc{{engine="0",model_name="{MODEL}"}}' in text
    m = server.metrics()
    slots = m["kvtool:kv_offload_cpu_cache_slots"]
    pinned = m["vllm:kv_offload_cpu_cache_usage_perc"] * slots
    filled = m["kvtool:kv_offload_cpu_cache_filled_perc"] * slots
    assert slots >= 1 and 0 <= round(pinned) <= round(filled) <= slots and round(filled) >= 4
    assert abs(pinned - round(pinned)) < 1e-6 and abs(filled - round(filled)) < 1e-6


@pytest.mark.parametrize("stream", [False, True])
def test_a_complete_grammar_ends_the_request_before_min_tokens(client, engine, stream):
    # After "yes" the grammar allows only EOS, which min_tokens would ban: the grammar's end wins.
    out = client.completions.create(model=MODEL, prompt="yes or no:", max_tokens=40, temperature=1.0, seed=3,
                                    stream=stream, stream_options={"include_usage": True} if stream else None,
                                    extra_body={"guided_choice": ["yes"], "min_tokens": 20})
    chunks = list(out) if stream else [out]
    text = "".join(c.text for ch in chunks for c in ch.choices)
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    usage = [ch.usage for ch in chunks if ch.usage][-1]
    assert (text, finish, usage.completion_tokens) == ("yes", ["stop"], 4)  # "yes" and EOS
    # Where the grammar may go on, min_tokens still holds: digits until 6 tokens at least.
    digits = client.completions.create(model=MODEL, prompt="n:", max_tokens=12, temperature=1.0, seed=4,
                                       logit_bias={str(t): 50 for t in engine.model_config.eos_token_ids},  # EOS once allowed
                                       extra_body={"guided_regex": "[0-9]+", "min_tokens": 6})
    assert re.fullmatch("[0-9]+", digits.choices[0].text) and digits.usage.completion_tokens == 7


def test_ignore_eos_with_a_complete_grammar_runs_to_max_tokens_and_keeps_its_text(client):
    out = client.completions.create(model=MODEL, prompt="yes or no:", max_tokens=12, temperature=0,
                                    extra_body={"guided_choice": ["yes"], "ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens) == ("yes", "length", 12)
    _assert_serving(client)
