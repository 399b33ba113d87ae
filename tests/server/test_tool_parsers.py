"""Tool-call parsers: what they find in a whole output, and that a streamed output, cut anywhere,
gives the same calls and content in the same order."""

import json
import random

import pytest

from kvtool.server.tool_parsers import TOOL_CALL_PARSERS, ExtractedToolCalls, ParsedToolCall, extract_tool_calls
from kvtool.server.tool_parsers.required import RequiredToolCallsParser

HERMES = TOOL_CALL_PARSERS["hermes"]
LLAMA = TOOL_CALL_PARSERS["llama3_json"]


def _call(name: str, **arguments) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _streamed(parser_cls, text: str, cuts: list[int]) -> tuple[ExtractedToolCalls, list[list]]:
    """The output pushed in the pieces `cuts` makes; returns what it adds up to and each push's pieces."""
    parser = parser_cls()
    bounds = [0, *sorted(set(cuts)), len(text)]
    steps = [parser.push(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    pieces = [p for step in steps for p in step]
    content = "".join(p for p in pieces if isinstance(p, str))
    return ExtractedToolCalls([p for p in pieces if isinstance(p, ParsedToolCall)], content if content.strip() else None), steps


def _assert_streams_alike(parser_cls, text: str) -> ExtractedToolCalls:
    whole = extract_tool_calls(parser_cls(), text)
    assert _streamed(parser_cls, text, list(range(1, len(text))))[0] == whole  # one character at a time
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))) if len(text) > 1 else []
        assert _streamed(parser_cls, text, cuts)[0] == whole, cuts
    return whole


# ---- hermes ------------------------------------------------------------------------------------

HERMES_CASES = [
    # one call, the way Qwen writes it
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [_call("get_weather", city="Paris")], None),
    # text before a call is content
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [_call("get_weather", city="Paris")], "Let me check.\n"),
    # several calls, in order; the newline between them is no content
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     [_call("a", x=1), _call("b")], None),
    # malformed JSON inside the tags stays content, tags and all; the good call is still found
    ('<tool_call>{"name": get_weather}</tool_call> then <tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>',
     [_call("b", y=[1, 2])], '<tool_call>{"name": get_weather}</tool_call> then '),
    # no `arguments`, or a name that is no string: content
    ('<tool_call>{"name": "a"}</tool_call>', [], '<tool_call>{"name": "a"}</tool_call>'),
    ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', [], '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    # a call the model did not close before stopping still counts when its JSON is whole
    ('<tool_call>\n{"name": "a", "arguments": {"s": "é</tool"}}', [_call("a", s="é</tool")], None),
    # ... and is content when it is not
    ('ok <tool_call>{"name": "a", "argu', [], 'ok <tool_call>{"name": "a", "argu'),
    # things that only look like the tag
    ("a < b and <tool_cal", [], "a < b and <tool_cal"),
    ("no calls at all", [], "no calls at all"),
    ("", [], None),
]


@pytest.mark.parametrize("text,calls,content", HERMES_CASES)
def test_hermes_finds_calls_and_content(text, calls, content):
    found = _assert_streams_alike(HERMES, text)
    assert found.calls == calls
    assert found.content == content


def test_hermes_streams_a_call_once_its_tag_closes_and_text_at_once():
    text = 'Hi <tool_call>{"name": "a", "arguments": {}}</tool_call>'
    close = text.index("</tool_call>")
    parser = HERMES()
    assert parser.push(text[:6]) == ["Hi "]  # "<to" may begin the tag: held back
    assert parser.push(text[6:close]) == []  # the call's JSON is complete, its tag is not
    assert parser.push(text[close:]) == [_call("a")]
    assert parser.finish() == []


def test_hermes_arguments_keep_unicode_and_the_model_s_values():
    found = extract_tool_calls(HERMES(), '<tool_call>{"name": "f", "arguments": {"q": "naïve ☃", "n": 1.5}}</tool_call>')
    assert json.loads(found.calls[0].arguments) == {"q": "naïve ☃", "n": 1.5}
    assert "☃" in found.calls[0].arguments


def test_hermes_call_nested_deeper_than_the_bound_is_content_not_an_error():
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    found = _streamed(HERMES, deep, [100, 3000, 9000])[0]
    assert found.calls == [] and found.content == deep


# ---- llama3_json -------------------------------------------------------------------------------

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [_call("get_weather", city="Paris")], None),
    # `arguments` is read as well, after <|python_tag|> and whitespace
    (' <|python_tag|>{"name": "a", "arguments": {"x": [1, "}"]}}', [_call("a", x=[1, "}"])], None),
    # several calls separated by `;`
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}', [_call("a"), _call("b", y=2)], None),
    # text after the calls is content; text before means no calls
    ('{"name": "a", "parameters": {}} and more', [_call("a")], "and more"),
    ('Sure: {"name": "a", "parameters": {}}', [], 'Sure: {"name": "a", "parameters": {}}'),
    # malformed, nameless or unfinished objects are content
    ('{"name": a}', [], '{"name": a}'),
    ('{"function": "a", "parameters": {}}', [], '{"function": "a", "parameters": {}}'),
    ('{"name": "a", "parameters": {}}; {"name": "b", "param', [_call("a")], '{"name": "b", "param'),
    ("<|python_tag|>", [], "<|python_tag|>"),
    ("   ", [], None),
]


@pytest.mark.parametrize("text,calls,content", LLAMA_CASES)
def test_llama3_json_finds_calls_and_content(text, calls, content):
    found = _assert_streams_alike(LLAMA, text)
    assert found.calls == calls
    assert found.content == content


def test_llama3_json_streams_each_call_as_its_object_closes():
    parser = LLAMA()
    assert parser.push('{"name": "a", "parameters": {"x": 1}') == []
    assert parser.push("}; ") == [_call("a", x=1)]
    assert parser.push('{"name": "b", "parameters": {}}') == [_call("b")]
    assert parser.finish() == []


def test_an_output_that_starts_as_text_streams_at_once():
    parser = LLAMA()
    assert parser.push("Hello") == ["Hello"]
    assert parser.push(" {") == [" {"]


# ---- the array that tool_choice "required" forces ----------------------------------------------------


def test_required_array_gives_each_element_once_it_closes():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    found = _assert_streams_alike(RequiredToolCallsParser, text)
    assert found == ExtractedToolCalls([_call("a", x=1), _call("b")], None)
    steps = _streamed(RequiredToolCallsParser, text, [text.index("}}") + 1, text.index("}}") + 2])[1]
    assert steps[0] == [] and steps[1] == [_call("a", x=1)]


def test_required_array_cut_short_keeps_the_complete_calls():
    found = _assert_streams_alike(RequiredToolCallsParser, '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"s": "x')
    assert found == ExtractedToolCalls([_call("a")], None)
