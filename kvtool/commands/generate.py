"""`kvtool generate`: offline generation of one or more prompts in one batch."""

import json
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.table import Table

from kvtool.commands import render
from kvtool.commands.engine_build import open_engine
from kvtool.commands.options import JsonOpt, with_engine_options
from kvtool.engine.errors import InputError, KVLoadError
from kvtool.engine.params import EngineParams, SamplingParams


class GeneratedRequest(msgspec.Struct, kw_only=True):
    """One request of `kvtool generate --json` (scripts rely on these names)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    ttft_s: float | None
    decode_s: float | None
    error: str | None = None


class GenerateReport(msgspec.Struct):
    requests: list[GeneratedRequest]


def read_prompt_file(path: Path) -> list[dict]:
    """One prompt per line, or JSON Lines with `prompt` or `prompt_token_ids`."""
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: malformed JSON ({e.msg})") from None
            if not isinstance(obj.get("prompt_token_ids", obj.get("prompt")), (str, list)):
                raise InputError(f"{path}:{n}: a JSON line needs `prompt` (string) or `prompt_token_ids` (list)")
            items.append(obj)
        else:
            items.append({"prompt": line})
    return items


@with_engine_options
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="A prompt (repeat for a batch).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="One prompt per line, or JSON Lines with prompt / prompt_token_ids.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt as a user message through the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate per request.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS.")] = False,
    json_out: JsonOpt = False,
    *,
    engine: EngineParams,
) -> None:
    """Generate text for one or more prompts.

    Examples:
      kvtool generate --chat --prompt "What is the capital of France?"
      kvtool generate --model DIR --prompt-file prompts.jsonl --json
    """
    items = [{"prompt": p} for p in prompt or []]
    if prompt_file is not None:
        items += read_prompt_file(prompt_file)
    if not items:
        raise InputError("give at least one --prompt or a --prompt-file")
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos
    )
    with open_engine(engine, show_progress=not json_out) as llm:
        prompts = []
        for item in items:
            if "prompt_token_ids" in item:
                prompts.append([int(t) for t in item["prompt_token_ids"]])
            else:
                prompts.append(llm.encode_prompt(item["prompt"], chat=chat))
        salts = [item.get("cache_salt") for item in items]
        results = llm.generate(prompts, sampling, cache_salts=salts)
    report = GenerateReport(
        requests=[
            GeneratedRequest(
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                text=r.text,
                finish_reason=r.finish_reason,
                num_prompt_tokens=r.stats.num_prompt_tokens,
                num_cached_tokens=r.stats.num_cached_tokens,
                num_external_tokens=r.stats.num_external_tokens,
                ttft_s=r.stats.ttft_s,
                decode_s=r.stats.decode_s,
                error=r.error,
            )
            for r in results
        ]
    )
    if json_out:
        render.print_json(report)
    else:
        _render_text(report)
    failed = [r for r in report.requests if r.finish_reason == "error"]
    if failed:
        raise KVLoadError(failed[0].error or "a request failed")


def _render_text(report: GenerateReport) -> None:
    many = len(report.requests) > 1
    for i, r in enumerate(report.requests):
        if many:
            render.stdout.print(f"[bold]--- request {i}[/bold]", highlight=False)
        render.stdout.print(r.text, markup=False, highlight=False)
    table = Table(title=None, show_edge=False)
    for col in ("#", "prompt", "cached", "external", "output", "finish", "TTFT ms"):
        table.add_column(col, justify="right")
    for i, r in enumerate(report.requests):
        ttft = f"{r.ttft_s * 1000:.1f}" if r.ttft_s is not None else "-"
        table.add_row(
            str(i), str(r.num_prompt_tokens), str(r.num_cached_tokens), str(r.num_external_tokens),
            str(len(r.output_token_ids)), r.finish_reason, ttft,
        )
    render.stderr.print(table)
