"""POST /v1/completions: one choice per prompt and per n, streamed or not, with echo and logprobs."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from kvtool.server.context import ServerContext, by_logprob, new_call_id, usage_of
from kvtool.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from kvtool.server.sampling import DEFAULT_COMPLETION_MAX_TOKENS, make_sampling, resolve_max_tokens
from kvtool.server.streamed_choices import stream_choices
from kvtool.server.streaming import IncrementalText, Reply, json_response, sse, sse_response, start_all, wait_all


async def create_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    model = ctx.check_model(body.model)
    body.refuse_unsupported()
    prompts = body.prompts()
    for p in prompts:
        if isinstance(p, str):
            ctx.check_text_length(p)
    prompt_ids = [
        await anyio.to_thread.run_sync(ctx.tokenizer.encode, p, True) if isinstance(p, str) else list(p) for p in prompts
    ]
    default_max = ctx.defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    call_id = new_call_id("cmpl")
    jobs, prompt_of, first_of_prompt = [], [], []
    for pi, ids in enumerate(prompt_ids):
        max_tokens = resolve_max_tokens(body.max_tokens, "max_tokens", len(ids), ctx.max_model_len, default_max)
        first = len(jobs)
        for j in range(body.n):
            sampling = make_sampling(body, max_tokens=max_tokens, logprobs=body.logprobs, defaults=ctx.defaults,
                                     tokenizer=ctx.tokenizer, seed_offset=j)
            jobs.append(ctx.job(call_id, ids, sampling, body, len(jobs), share_prefix_with=first if j else None))
            prompt_of.append(pi)
            first_of_prompt.append(j == 0)
    echo = [_echo_text(ctx, prompts[pi], prompt_ids[pi]) if body.echo else "" for pi in prompt_of]
    handles = await start_all(ctx.engine_loop, jobs, request)
    reply = Reply(call_id, model, ctx.started, body.return_token_ids)
    if body.stream:
        return sse_response(_stream(ctx, handles, reply, body, echo, [prompt_ids[pi] for pi in prompt_of], first_of_prompt))
    events = await wait_all(handles)
    if events is None:
        return Response(status_code=499)
    choices = []
    for i, event in enumerate(events):
        r = event.result
        logprobs = _logprobs(ctx, r.output_token_ids, r.logprobs or [], 0) if body.logprobs is not None else None
        choice = CompletionChoice(index=i, text=echo[i] + r.text, logprobs=logprobs, finish_reason=r.finish_reason,
                                  stop_reason=event.stop_reason)
        if body.return_token_ids:
            choice.prompt_token_ids = prompt_ids[prompt_of[i]]
            choice.token_ids = r.output_token_ids
        choices.append(choice)
    resp = CompletionResponse(
        id=call_id, object="text_completion", created=reply.created, model=model, choices=choices,
        usage=usage_of([e.result for e in events], first_of_prompt), kv_transfer_params=events[0].kv_transfer_params,
    )
    return json_response(resp)


def _echo_text(ctx: ServerContext, prompt: str | list[int], ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids)


def _logprobs(ctx: ServerContext, token_ids: list[int], entries: list[dict[int, float]], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for tid, entry in zip(token_ids, entries):
        s = ctx.token_string(tid)
        out.tokens.append(s)
        out.token_logprobs.append(entry.get(tid))
        out.top_logprobs.append({ctx.token_string(i): lp for i, lp in by_logprob(entry)})
        out.text_offset.append(offset)
        offset += len(s)
    return out


async def _stream(ctx: ServerContext, handles, reply: Reply, body: CompletionRequest, echo: list[str],
                  prompt_ids: list[list[int]], first_of_prompt: list[bool]):
    """Server-sent events of every choice, interleaved, then usage (if asked for) and [DONE]."""
    want_logprobs = body.logprobs is not None
    every_step = want_logprobs or reply.return_token_ids
    texts = [IncrementalText(ctx.tokenizer, body.stop_strings) for _ in handles]
    offsets = [0] * len(handles)
    first = [True] * len(handles)

    def chunk(i: int, delta: str, token_ids: list[int], logprobs: list[dict[int, float]], final: dict[str, Any]) -> str:
        choice = CompletionChoice(index=i, text=delta, logprobs=None, **final)
        if want_logprobs:
            choice.logprobs = _logprobs(ctx, token_ids, logprobs, offsets[i])
            offsets[i] += sum(len(t) for t in choice.logprobs.tokens)
        if reply.return_token_ids:
            choice.token_ids = token_ids
            if first[i]:
                choice.prompt_token_ids = prompt_ids[i]
        first[i] = False
        return sse(CompletionResponse(id=reply.id, object="text_completion", created=reply.created,
                                      model=reply.model, choices=[choice]))

    for i, text in enumerate(echo):
        if text:
            yield chunk(i, text, [], [], {"finish_reason": None})

    def usage_chunk(results) -> str:
        return sse(CompletionResponse(id=reply.id, object="text_completion", created=reply.created,
                                      model=reply.model, choices=[], usage=usage_of(results, first_of_prompt)))

    async for line in stream_choices(handles, texts, chunk, every_step=every_step,
                                     usage_chunk=usage_chunk if body.include_usage else None):
        yield line
