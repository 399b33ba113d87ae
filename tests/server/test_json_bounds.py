"""JSON depth and size bounds: measured without recursion, and naming the field at fault."""

import json

import pytest

from kvtool.server.json_bounds import (
    MAX_FREE_FORM_VALUES, MAX_JSON_DEPTH, JSONTooBig, loads_bounded, object_end, refuse_deep_json, refuse_large_value,
)


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_the_bound_itself_passes_and_one_more_level_is_refused_naming_the_field():
    refuse_deep_json(json.dumps({"k": json.loads(_nested(MAX_JSON_DEPTH - 1))}))
    with pytest.raises(JSONTooBig) as e:
        refuse_deep_json('{"prompt": "x", "kv_transfer_params": {"a": ' + _nested(MAX_JSON_DEPTH) + "}}")
    assert e.value.field == "kv_transfer_params"
    assert str(e.value).startswith("`kv_transfer_params` in the request body nests")


def test_thousands_of_levels_are_refused_at_once_and_a_bare_array_names_no_field():
    for body in (_nested(100_000), "{" * 100_000, '{"a": ' * 5000):
        with pytest.raises(JSONTooBig) as e:
            refuse_deep_json(body)
        assert e.value.field in (None, "a")


def test_brackets_and_keys_inside_strings_do_not_count():
    text = json.dumps({"prompt": "[[[[{{{{" * 1000 + '\\"', "messages": [{"content": '{"fake": ' * 100}]})
    refuse_deep_json(text)
    # A key of a nested object is no top-level field.
    with pytest.raises(JSONTooBig) as e:
        refuse_deep_json('{"tools": [{"inner": ' + _nested(MAX_JSON_DEPTH) + "}]}")
    assert e.value.field == "tools"


def test_text_that_is_no_json_is_left_to_the_parser():
    refuse_deep_json('{"a": "never closed [[[[[[')
    refuse_deep_json("]]]]}}}")
    with pytest.raises(ValueError):
        loads_bounded("{nope", "x")


def test_object_end_waits_for_an_open_string_and_finds_the_closing_bracket():
    assert object_end('{"a": "x}', 0) is None
    assert object_end('{"a": "x}"}', 0) == 11
    assert object_end('{"a\\"": [1, {}]} tail', 0) == len('{"a\\"": [1, {}]}')
    with pytest.raises(JSONTooBig):
        object_end(_nested(MAX_JSON_DEPTH + 1), 0)


def test_free_form_values_are_counted_and_their_depth_bounded():
    refuse_large_value({"a": list(range(MAX_FREE_FORM_VALUES - 2))}, "v")
    with pytest.raises(JSONTooBig, match="more than 65536 JSON values"):
        refuse_large_value({"a": list(range(MAX_FREE_FORM_VALUES))}, "v")
    deep: list = []
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    with pytest.raises(JSONTooBig, match="levels deep"):
        refuse_large_value(deep, "v")
