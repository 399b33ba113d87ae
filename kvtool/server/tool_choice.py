"""Which tool calls a chat request asks for, under vLLM 0.33's rules, and the grammar that forces them.

`resolve_tool_choice` reads `tools`, `tool_choice` and `parallel_tool_calls` into a ToolChoice,
refusing with vLLM's messages (a 400 naming the field):

- `tools: []`; a `tool_choice` without `tools`; a `tool_choice` other than "none", "auto",
  "required" or `{"type": "function", "function": {"name": NAME}}`; a NAME no tool has;
- "auto" (the default when `tools` is given) unless the server runs with
  `--enable-auto-tool-choice --tool-call-parser NAME`, and "required" or a named function
  unless it does too: as in vLLM, the tool parser is active only with both flags;
- a named function beside `structured_outputs` (or a guided_* field): a request cannot be
  constrained by both. With "required" or a named function, the calls' grammar replaces
  `response_format` and the other structured-output fields, as in vLLM.

`tool_call_schema` is that grammar, a JSON schema that structured outputs compile with llguidance,
so a forced call always parses and its arguments always match the function's schema: for a named
function, its parameters (the output is the arguments object itself); for "required", an array
of at least one `{"name": NAME, "parameters": {...}}` (at most one without parallel tool calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvtool.server.protocol import ChatCompletionRequest, ChatTool, InvalidField

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A chat request's tool calling, resolved."""

    # none: plain text (the template still sees the tools); auto: the tool parser finds calls in
    # the output; required / named: the grammar forces calls.
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[ChatTool, ...] = ()
    # The function a named tool_choice forces.
    function_name: str | None = None
    # False when the request set parallel_tool_calls: false (then only the first call counts).
    parallel: bool = True

    @property
    def forces_calls(self) -> bool:
        return self.mode in ("required", "named")


NO_TOOLS = ToolChoice("none")


def resolve_tool_choice(body: ChatCompletionRequest, *, tool_call_parser: str | None,
                        enable_auto_tool_choice: bool) -> ToolChoice:
    """The request's ToolChoice; raises InvalidField for the combinations vLLM refuses."""
    if body.tools is not None and not body.tools:
        raise InvalidField("tools", "`tools` must not be an empty array. Either provide at least one tool or "
                                    "omit the field entirely.")
    explicit = "tool_choice" in body.model_fields_set
    choice = body.tool_choice if explicit else ("auto" if body.tools else None)
    # An explicit null is no request for calls (vLLM extracts none); the template still sees the tools.
    if choice is None or choice == "none":
        return ToolChoice("none", tuple(body.tools or ()))
    if body.tools is None:
        raise InvalidField("tool_choice", "When using `tool_choice`, `tools` must be set.")
    tools = tuple(body.tools)
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        resolved = ToolChoice("named", tools, _named_function(choice, tools), parallel)
    elif choice in ("auto", "required"):
        resolved = ToolChoice(choice, tools, None, parallel)
    else:
        raise InvalidField("tool_choice", f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                                          '"none", "auto" or "required" are supported.')
    if not (enable_auto_tool_choice and tool_call_parser):
        raise InvalidField("tool_choice", _needs_parser(resolved))
    if resolved.mode == "named":
        given = next((f for f in _STRUCTURED_FIELDS if getattr(body, f) is not None), None)
        if given is not None:
            raise InvalidField(given, "You can only either use constraints for structured outputs or tools, not both.")
    return resolved


def _named_function(choice: dict[str, Any], tools: tuple[ChatTool, ...]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise InvalidField("tool_choice.function",
                           f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}")
    if "name" not in function:
        raise InvalidField("tool_choice.function.name",
                           f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise InvalidField("tool_choice.function.name",
                           f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}")
    # OpenAI's shape, strictly: the type is "function" and nothing else is there.
    if choice.get("type", "function") != "function" or set(choice) - {"type", "function"} or set(function) != {"name"}:
        raise InvalidField("tool_choice", f"Invalid value for `tool_choice`: {choice}! {_NAMED_USAGE}")
    if all(t.function.name != name for t in tools):
        raise InvalidField("tool_choice", "The tool specified in `tool_choice` does not match any of the specified `tools`")
    return name


def _needs_parser(choice: ToolChoice) -> str:
    if choice.mode == "auto":
        return '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    what = f'function "{choice.function_name}"' if choice.mode == "named" else '"required"'
    # vLLM names only --tool-call-parser here, but its parser is active only beside --enable-auto-tool-choice.
    return f"tool_choice={what} requires --enable-auto-tool-choice and --tool-call-parser to be set"


def tool_call_schema(choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema that forces the request's calls (None unless "required" or named).

    Raises InvalidField("tools") when the tools' `$defs` cannot share one schema.
    """
    if choice.mode == "named":
        tool = next(t for t in choice.tools if t.function.name == choice.function_name)
        return _parameters_schema(tool.function.parameters)
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for tool in choice.tools:
        params = dict(tool.function.parameters or {})
        _merge_defs(defs, params.pop("$defs", {}), tool.function.name)
        branches.append({
            "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                           "parameters": _parameters_schema(params)},
            "required": ["name", "parameters"],
            # Nothing beside the call: vLLM ignores other keys, and a grammar without them ends sooner.
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not choice.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters_schema(params: dict[str, Any] | None) -> dict[str, Any]:
    # No parameters still means an arguments object.
    return params if params else {"type": "object", "properties": {}}


def _merge_defs(defs: dict[str, Any], new: Any, tool_name: str) -> None:
    if not isinstance(new, dict):
        raise InvalidField("tools", f"`$defs` in the parameters of tool '{tool_name}' must be an object, "
                                    f"got {type(new).__name__}.")
    for name, schema in new.items():
        if name in defs and defs[name] != schema:
            raise InvalidField("tools", f"Tool definition '{name}' has multiple schemas, which is not supported.")
        defs[name] = schema
