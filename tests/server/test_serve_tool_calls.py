"""Tool calls in /v1/chat/completions against a real `kvtool serve`, driven by the `openai` client.

The same tests run on two servers, both started as a vLLM user would start them for a Qwen
model (`--enable-auto-tool-choice --tool-call-parser hermes`): the embedded default model
(SmolLM2-135M-Instruct, no --model) and a tiny random model. Neither model's own template renders
`tools` (vLLM hands them to it all the same), so both run with a ChatML template that does
(tests/data/tool_chat_template_hermes.jinja, in the Qwen2.5 format).

tool_choice "required" or a named function is forced by the grammar, so the arguments validate
against the function's schema whatever the weights. "auto" leaves the model free: the default
model, shown three calls earlier in the conversation, calls the tool by itself; on either model
a guided regex can write a call in the hermes format, which tests the parser and its stream end
to end. A third server reads llama3_json.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import kvtool_cmd
from tests.support.server_process import REPO_ROOT, ServerProcess

TEMPLATE = REPO_ROOT / "tests" / "data" / "tool_chat_template_hermes.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module", params=["default", "tiny"])
def server(request, tiny_model_dir):
    model = [] if request.param == "default" else [str(tiny_model_dir), "--max-model-len", "4096"]
    flags = [*model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE)]
    with ServerProcess(flags, startup_timeout_s=900) as s:
        s.kind = request.param
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _streamed(client, **kwargs) -> tuple[str | None, list[dict], str, list]:
    """A streamed reply summed up as a client does: its content, its calls, its finish reason, its chunks."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content, calls, finish = None, {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "type": d.type, "name": "", "arguments": ""})
            assert d.id is None or call["id"] == d.id  # only the first delta of a call has its id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, chunks


def _check_call(call) -> dict:
    """One call of a reply: OpenAI's shape, vLLM's id, and arguments that validate; returns the arguments."""
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 16
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def _same_streamed(client, reply, **kwargs) -> None:
    """The streamed reply of the same (greedy) request carries the same content and calls."""
    content, calls, finish, _ = _streamed(client, **kwargs)
    message = reply.choices[0].message
    assert (content or None) == (message.content or None)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert finish == reply.choices[0].finish_reason


def test_a_named_function_is_called_with_arguments_that_validate(client, model):
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=GET_WEATHER, max_tokens=60, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.message.content == "" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    _check_call(choice.message.tool_calls[0])
    # OpenAI's answer for a forced function: "stop", not "tool_calls".
    assert choice.finish_reason == "stop"
    _same_streamed(client, reply, **kwargs)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_one_or_more_tools_with_arguments_that_validate(client, model, parallel):
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=0, parallel_tool_calls=parallel)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.message.content == "" and choice.message.tool_calls
    if parallel:
        # The model decides when the array ends (a random one may go on to max_tokens); the calls
        # complete by then are the reply's.
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        _check_call(call)
    _same_streamed(client, reply, **kwargs)


def test_auto_reads_a_hermes_call_and_the_text_before_it(client, model):
    # The grammar writes the call; the parser must find it and keep the text before it.
    call = '{"name": "get_time", "arguments": {"zone": "JST"}}'
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=0,
                  extra_body={"guided_regex": "Let me look\\.\n<tool_call>\n" + _regex_literal(call) + "\n</tool_call>"})
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.message.content == "Let me look.\n"
    assert [(c.function.name, _check_call(c)) for c in choice.message.tool_calls] == [("get_time", {"zone": "JST"})]
    assert choice.finish_reason == "tool_calls"
    _same_streamed(client, reply, **kwargs)


def test_auto_without_a_call_is_plain_content(client, model):
    kwargs = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=0,
                  extra_body={"guided_regex": "It is <tool_call> sunny\\."})
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].message.content == "It is <tool_call> sunny."
    assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"
    _same_streamed(client, reply, **kwargs)


def _few_shot(cities: list[str]) -> list[dict]:
    """Earlier turns in which the assistant answered each question by calling the tool."""
    messages = [{"role": "system", "content": "You answer every question by calling a tool."}]
    for i, city in enumerate(cities):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"},
            {"role": "assistant", "content": f"It is sunny in {city}."},
        ]
    return messages


def test_the_default_model_calls_a_tool_by_itself_under_auto(server, client, model):
    if server.kind != "default":
        pytest.skip("a random model calls no tool by itself")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    messages = _few_shot(["Rome", "Berlin", "Madrid"]) + [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=model, messages=messages, tools=tools, max_tokens=40, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    _same_streamed(client, reply, **kwargs)


def test_the_tool_result_comes_back_and_the_second_turn_reuses_the_first_s_kv(server, client, model):
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=GET_WEATHER,
                                           max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    arguments = _check_call(call)
    hits_before = server.metrics()["vllm:prefix_cache_hits_total"]
    # The assistant's turn goes back as the client got it, then the tool's answer to its call.
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The system prompt with the tools and the question are the first turn's prompt: their blocks are hits.
    assert cached > 0 and cached >= first.usage.prompt_tokens // 16 * 16 - 16
    assert server.metrics()["vllm:prefix_cache_hits_total"] - hits_before == cached
    # The template rendered the call (its arguments as an object) and the tool's answer.
    prompt_ids = second.model_extra["prompt_token_ids"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt_ids}, timeout=60).json()["prompt"]
    assert f'{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt


@pytest.mark.parametrize("body,param,message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`: sometimes!"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, None, "invalid structured-output request"),
    ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}],
      "tools": TOOLS}, "messages", "function.name"),
])
def test_bad_tool_requests_are_a_400_and_the_server_keeps_serving(server, client, model, body, param, message):
    r = httpx.post(f"{server.base_url}/chat/completions", json={"model": model, "messages": QUESTION, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error" and message in err["message"]
    if param is not None:
        assert err["param"] == param
    ok = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert ok.choices[0].message.tool_calls is None


# ---- llama3_json ---------------------------------------------------------------------------------


def test_llama3_json_reads_bare_json_calls_streamed_or_not(tiny_model_dir):
    flags = [str(tiny_model_dir), "--max-model-len", "4096", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    with ServerProcess(flags) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)
        calls = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}'
        kwargs = dict(model=str(tiny_model_dir), messages=QUESTION, tools=TOOLS, max_tokens=150, temperature=0,
                      extra_body={"guided_regex": _regex_literal(calls)})
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert [(c.function.name, _check_call(c)) for c in choice.message.tool_calls] == [
            ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "days": 3})]
        _same_streamed(client, reply, **kwargs)
        forced = client.chat.completions.create(model=str(tiny_model_dir), messages=QUESTION, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                                temperature=0)
        assert forced.choices[0].finish_reason == "tool_calls"
        _check_call(forced.choices[0].message.tool_calls[0])


def test_tool_flags_are_checked_at_startup(tiny_model_dir):
    for flags, words in ((["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                         (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "invalid tool call parser: nope")):
        r = subprocess.run([*kvtool_cmd(), "serve", str(tiny_model_dir), *flags], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches only itself."""
    import re

    return re.escape(text)
