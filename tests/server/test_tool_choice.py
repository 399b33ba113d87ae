"""tool_choice under vLLM's rules, the grammar that forces calls, and a choice's calls in the reply
(whole and streamed)."""

import json

import jsonschema
import pytest
import tokenizers

from kvtool.engine.core.structured_output import StructuredOutputs
from kvtool.engine.params import StructuredOutputsParams
from kvtool.engine.worker.sampler import unpack_bitmask
from kvtool.server.protocol import ChatCompletionRequest, InvalidField
from kvtool.server.tool_calls import ToolCallStream, finish_reason, read_message
from kvtool.server.tool_choice import ToolChoice, resolve_tool_choice, tool_call_schema

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "hi"}]
ACTIVE = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
EOS = 258  # the tiny model's


def _resolve(flags=ACTIVE, **fields) -> ToolChoice:
    return resolve_tool_choice(ChatCompletionRequest(messages=MESSAGES, **fields), **flags)


def _refused(flags=ACTIVE, **fields) -> InvalidField:
    with pytest.raises(InvalidField) as e:
        _resolve(flags, **fields)
    return e.value


# ---- which requests may ask for calls --------------------------------------------------------------


def test_tools_default_to_auto_and_an_explicit_none_or_null_reads_no_calls():
    assert _resolve(tools=TOOLS).mode == "auto"
    assert _resolve().mode == "none"
    for choice in ("none", None):
        resolved = _resolve(tools=TOOLS, tool_choice=choice)
        assert resolved.mode == "none" and len(resolved.tools) == 2  # the template still sees the tools


def test_named_and_required_resolve_with_parallel_tool_calls():
    named = _resolve(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.function_name, named.forces_calls) == ("named", "get_time", True)
    assert _resolve(tools=TOOLS, tool_choice="required").parallel
    assert not _resolve(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).parallel


@pytest.mark.parametrize("fields,param,message", [
    ({"tools": []}, "tools", "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely."),
    ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice",
     'Invalid value for `tool_choice`: always! Only named tools, "none", "auto" or "required" are supported.'),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "Invalid value for `function`: `None`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name",
     "Expected field `name` in `function` in `tool_choice`!"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}}, "tool_choice.function.name",
     "Invalid `name` in `function`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "retrieval", "function": {"name": "get_time"}}}, "tool_choice",
     "Invalid value for `tool_choice`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "You can only either use constraints for structured outputs or tools, not both."),
])
def test_vllm_s_refusals_name_the_field(fields, param, message):
    e = _refused(**fields)
    assert e.param == param
    assert str(e).startswith(message)


@pytest.mark.parametrize("flags", [{"tool_call_parser": None, "enable_auto_tool_choice": False},
                                   {"tool_call_parser": "hermes", "enable_auto_tool_choice": False}])
def test_calls_need_the_tool_parser_active(flags):
    assert str(_refused(flags, tools=TOOLS)) == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                 "--tool-call-parser to be set")
    assert str(_refused(flags, tools=TOOLS, tool_choice="required")).startswith('tool_choice="required" requires')
    named = _refused(flags, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert str(named).startswith('tool_choice=function "get_time" requires') and named.param == "tool_choice"
    assert _resolve(flags, tools=TOOLS, tool_choice="none").mode == "none"


def test_required_or_named_replace_response_format_as_in_vllm():
    fields = {"tools": TOOLS, "response_format": {"type": "json_object"}}
    assert _resolve(tool_choice="required", **fields).mode == "required"
    assert _resolve(tool_choice={"type": "function", "function": {"name": "get_time"}}, **fields).mode == "named"


# ---- the grammar of forced calls -------------------------------------------------------------------


def test_named_schema_is_the_function_s_parameters_or_any_object():
    assert tool_call_schema(_resolve(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})) == WEATHER
    assert tool_call_schema(_resolve(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})) == {
        "type": "object", "properties": {}}
    assert tool_call_schema(_resolve(tools=TOOLS)) is None


def test_required_schema_takes_every_tool_s_call_and_no_other():
    schema = tool_call_schema(_resolve(tools=TOOLS, tool_choice="required"))
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}],
                [{"name": "other", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_call_schema(_resolve(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


def test_required_schema_hoists_defs_and_refuses_two_schemas_under_one_name():
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": defs}}}

    point = {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    schema = tool_call_schema(_resolve(tools=[tool("a", point), tool("b", point)], tool_choice="required"))
    assert schema["$defs"] == point
    jsonschema.validate([{"name": "a", "parameters": {"p": {"x": 1}}}], schema)
    clash = _resolve(tools=[tool("a", point), tool("b", {"Point": {"type": "string"}})], tool_choice="required")
    with pytest.raises(InvalidField) as e:
        tool_call_schema(clash)
    assert e.value.param == "tools" and "Point" in str(e.value)


@pytest.fixture
def grammar(tiny_model_dir):
    """llguidance over the tiny model's byte-level tokenizer: one token per character."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return StructuredOutputs(tok.to_str, cfg["vocab_size"], [EOS])


def _grammar_takes(grammar, schema, text: str) -> bool:
    """Whether the grammar allows `text` token by token, then its end (EOS)."""
    grammar.add("r", StructuredOutputsParams(json=schema))
    try:
        for token in [*text.encode(), EOS]:
            allowed = unpack_bitmask(grammar.bitmask("r").unsqueeze(0), grammar.vocab_size)[0]
            if not allowed[token]:
                return False
            grammar.advance("r", [token])
        return True
    finally:
        grammar.remove("r")


def test_the_grammar_takes_what_the_parser_reads_as_calls(grammar):
    schema = tool_call_schema(_resolve(tools=TOOLS, tool_choice="required"))
    text = '[{"name":"get_weather","parameters":{"city":"Rome","days":3}},{"name":"get_time","parameters":{}}]'
    assert _grammar_takes(grammar, schema, text)
    assert not _grammar_takes(grammar, schema, '[{"name":"get_weather","parameters":{"city":"Oslo","days":3}}]')
    message = read_message(_resolve(tools=TOOLS, tool_choice="required"), "hermes", text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 3}), ("get_time", {})]


# ---- a choice's calls in the reply -------------------------------------------------------------------

HERMES_OUTPUT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _stream(choice: ToolChoice, text: str, size: int):
    """The streamed deltas of `text` pushed `size` characters at a time, summed up as a client does."""
    stream = ToolCallStream(choice, "hermes")
    content, calls = [], {}
    steps = [stream.push(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish("")]
    for text_delta, deltas in steps:
        if text_delta is not None:
            content.append(text_delta)
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return ("".join(content) if content else None), [calls[i] for i in sorted(calls)], stream


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_auto_calls_and_content_are_the_same_streamed_or_not(size):
    choice = _resolve(tools=TOOLS)
    whole = read_message(choice, "hermes", HERMES_OUTPUT)
    assert whole.content == "Checking.\n\n"
    assert [c.function.name for c in whole.tool_calls] == ["get_weather", "get_time"]
    assert all(c.id.startswith("chatcmpl-tool-") and len(c.id) == len("chatcmpl-tool-") + 16 for c in whole.tool_calls)
    content, calls, stream = _stream(choice, HERMES_OUTPUT, size)
    assert content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls) and stream.made_calls


def test_whitespace_around_calls_is_no_content_streamed_or_not():
    choice = _resolve(tools=TOOLS)
    text = '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
    assert read_message(choice, "hermes", text).content is None
    assert _stream(choice, text, 1)[0] is None


def test_parallel_tool_calls_false_keeps_the_first_call():
    choice = _resolve(tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in read_message(choice, "hermes", HERMES_OUTPUT).tool_calls] == ["get_weather"]
    assert [c["name"] for c in _stream(choice, HERMES_OUTPUT, 5)[1]] == ["get_weather"]


def test_named_arguments_stream_as_they_come_with_the_name_first():
    choice = _resolve(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    stream = ToolCallStream(choice, "hermes")
    first = stream.push('{"city"')[1]
    assert first[0].id.startswith("chatcmpl-tool-") and first[0].function.name == "get_weather"
    assert first[0].function.arguments == '{"city"'
    later = stream.push(':"Rome"}')[1]
    assert later[0].id is None and later[0].function.name is None and later[0].function.arguments == ':"Rome"}'
    whole = read_message(choice, "hermes", '{"city":"Rome"}')
    assert whole.content == "" and whole.tool_calls[0].function.arguments == '{"city":"Rome"}'


def test_required_content_is_empty_and_text_around_is_dropped():
    choice = _resolve(tools=TOOLS, tool_choice="required")
    text = '[{"name": "get_time", "parameters": {}}]'
    assert read_message(choice, "hermes", text).content == ""
    content, calls, _ = _stream(choice, text, 4)
    assert content is None and [c["name"] for c in calls] == ["get_time"]


def test_no_tool_choice_reads_no_calls():
    choice = _resolve(tools=TOOLS, tool_choice="none")
    assert read_message(choice, "hermes", HERMES_OUTPUT).content == HERMES_OUTPUT
    assert read_message(choice, "hermes", HERMES_OUTPUT).tool_calls == []


def test_finish_reason_is_tool_calls_only_for_calls_that_stopped_by_themselves():
    auto, named = _resolve(tools=TOOLS), _resolve(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert finish_reason(auto, "stop", True) == "tool_calls"
    assert finish_reason(auto, "length", True) == "length"
    assert finish_reason(auto, "stop", False) == "stop"
    assert finish_reason(named, "stop", True) == "stop"
