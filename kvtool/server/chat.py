"""POST /v1/chat/completions: the chat template, n choices, streamed or not, with logprobs and tool calls."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from kvtool.server.context import ServerContext, by_logprob, new_call_id, usage_of
from kvtool.server.errors import APIError
from kvtool.server.protocol import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatStreamChoice, ChoiceLogprobs, DeltaMessage, TokenLogprob, TopLogprob,
)
from kvtool.server.sampling import make_sampling, resolve_max_tokens
from kvtool.server.streamed_choices import stream_choices
from kvtool.server.streaming import IncrementalText, Reply, json_response, sse, sse_response, start_all, wait_all
from kvtool.server.tool_calls import ToolCallStream, finish_reason, read_message
from kvtool.server.tool_choice import ToolChoice, resolve_tool_choice, tool_call_schema


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    model = ctx.check_model(body.model)
    body.refuse_unsupported()
    settings = ctx.settings
    tools = resolve_tool_choice(body, tool_call_parser=settings.tool_call_parser,
                                enable_auto_tool_choice=settings.enable_auto_tool_choice)
    kwargs = dict(body.chat_template_kwargs or {})
    # The request's own tools are the template's `tools`, as transformers passes them.
    for reserved in ("messages", "add_generation_prompt", *(("tools",) if body.tools else ())):
        if reserved in kwargs:
            raise APIError(400, f"chat_template_kwargs may not set {reserved!r}", param="chat_template_kwargs")
    if body.tools:
        kwargs["tools"] = [t.to_template() for t in body.tools]
    messages = [m.to_template() for m in body.messages]
    ctx.check_text_length("".join(str(m.get("content", "")) for m in messages), "messages")
    tok = ctx.tokenizer
    prompt_ids = await anyio.to_thread.run_sync(
        lambda: tok.encode(tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **kwargs),
                           add_special_tokens=False)
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(body.requested_max_tokens, param, len(prompt_ids), ctx.max_model_len,
                                    ctx.defaults.max_tokens)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    schema = tool_call_schema(tools)
    call_id = new_call_id("chatcmpl")
    jobs = [
        ctx.job(call_id, prompt_ids, make_sampling(body, max_tokens=max_tokens, logprobs=num_top, defaults=ctx.defaults,
                                                   tokenizer=tok, seed_offset=j, tool_call_schema=schema), body, j,
                share_prefix_with=0 if j else None)
        for j in range(body.n)
    ]
    handles = await start_all(ctx.engine_loop, jobs, request)
    reply = Reply(call_id, model, ctx.started, body.return_token_ids)
    first_of_prompt = [j == 0 for j in range(body.n)]
    if body.stream:
        return sse_response(_stream(ctx, handles, reply, body, tools, num_top, prompt_ids, first_of_prompt))
    events = await wait_all(handles)
    if events is None:
        return Response(status_code=499)
    choices = []
    for i, event in enumerate(events):
        r = event.result
        logprobs = _logprobs(ctx, r.output_token_ids, r.logprobs or [], num_top) if num_top is not None else None
        found = read_message(tools, settings.tool_call_parser, r.text)
        message = AssistantMessage(role="assistant", content=found.content)
        if found.tool_calls:
            message.tool_calls = found.tool_calls
        choice = ChatChoice(index=i, message=message, logprobs=logprobs,
                            finish_reason=finish_reason(tools, r.finish_reason, bool(found.tool_calls)),
                            stop_reason=event.stop_reason)
        if body.return_token_ids:
            choice.token_ids = r.output_token_ids
        choices.append(choice)
    resp = ChatCompletionResponse(
        id=call_id, object="chat.completion", created=reply.created, model=model, choices=choices,
        usage=usage_of([e.result for e in events], first_of_prompt), kv_transfer_params=events[0].kv_transfer_params,
    )
    if body.return_token_ids:
        resp.prompt_token_ids = prompt_ids
    return json_response(resp)


def _logprobs(ctx: ServerContext, token_ids: list[int], entries: list[dict[int, float]], num_top: int) -> ChoiceLogprobs:
    content = []
    for tid, entry in zip(token_ids, entries):
        s = ctx.token_string(tid)
        top = [
            TopLogprob(token=ctx.token_string(i), logprob=lp, bytes=list(ctx.token_string(i).encode()))
            for i, lp in by_logprob(entry)[:num_top]
        ]
        lp = entry.get(tid)
        content.append(TokenLogprob(token=s, logprob=lp if lp is not None else float("-inf"),
                                    bytes=list(s.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=content)


async def _stream(ctx: ServerContext, handles, reply: Reply, body: ChatCompletionRequest, tools: ToolChoice,
                  num_top: int | None, prompt_ids: list[int], first_of_prompt: list[bool]):
    """Server-sent events: each choice opens with its role, then deltas, then its final chunk."""
    every_step = num_top is not None or reply.return_token_ids
    texts = [IncrementalText(ctx.tokenizer, body.stop_strings) for _ in handles]
    calls = [ToolCallStream(tools, ctx.settings.tool_call_parser) if tools.mode != "none" else None for _ in handles]
    first_chunk = [True]

    def chunk(i: int, delta: str | None, token_ids: list[int] | None, logprobs: list[dict[int, float]],
              final: dict[str, Any]) -> str | None:
        # The opening chunk carries the role; the closing one has no content unless text is left.
        if token_ids is None:
            message = DeltaMessage(role="assistant", content="")
        elif calls[i] is not None:
            message = _tool_delta(calls[i], delta or "", final)
            if message is None and not every_step:
                return None
            message = message or DeltaMessage()
        else:
            message = DeltaMessage(content=delta) if delta or final["finish_reason"] is None else DeltaMessage()
        choice = ChatStreamChoice(index=i, delta=message, logprobs=None, **final)
        if num_top is not None and token_ids:
            choice.logprobs = _logprobs(ctx, token_ids, logprobs, num_top)
        if reply.return_token_ids and token_ids is not None:
            choice.token_ids = token_ids
        out = ChatCompletionChunk(id=reply.id, object="chat.completion.chunk", created=reply.created,
                                  model=reply.model, choices=[choice])
        if reply.return_token_ids and first_chunk[0]:
            out.prompt_token_ids = prompt_ids
        first_chunk[0] = False
        return sse(out)

    for i in range(len(handles)):
        yield chunk(i, None, None, [], {"finish_reason": None})

    def usage_chunk(results) -> str:
        return sse(ChatCompletionChunk(id=reply.id, object="chat.completion.chunk", created=reply.created,
                                       model=reply.model, choices=[], usage=usage_of(results, first_of_prompt)))

    async for line in stream_choices(handles, texts, chunk, every_step=every_step,
                                     usage_chunk=usage_chunk if body.include_usage else None):
        yield line


def _tool_delta(calls: ToolCallStream, delta: str, final: dict[str, Any]) -> DeltaMessage | None:
    """The delta of a choice whose output is read for tool calls (None when there is nothing to
    send yet); on the final chunk, its finish reason becomes the chat's."""
    is_final = final["finish_reason"] is not None
    content, tool_calls = calls.finish(delta) if is_final else calls.push(delta)
    if is_final:
        final["finish_reason"] = finish_reason(calls.choice, final["finish_reason"], calls.made_calls)
    if content is None and not tool_calls:
        return DeltaMessage() if is_final else None
    message = DeltaMessage(content=content) if content is not None else DeltaMessage()
    if tool_calls:
        message.tool_calls = tool_calls
    return message
