"""The trace format: JSON Lines, one request per line, read strictly.

A line is an object with exactly one of `prompt` (text, encoded with the model's tokenizer) or
`prompt_token_ids` (a list of ids), and optionally:

    id            a name for the request in reports (default: "line N")
    arrival_s     seconds after the start of a pass at which the request is sent; without it,
                  the request is sent as soon as the request on the line before it has finished
    max_tokens, temperature, top_p, top_k, seed, ignore_eos, stop_token_ids
                  sampling, as vLLM names it; temperature defaults to 0 (greedy)
    cache_salt    vLLM's cache isolation salt

Blank lines and lines starting with `#` are skipped. Unknown keys, wrong types and values that
cannot be compared across arms (temperature > 0 without a seed) are refused with one line that
names the file and the line.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from kvtool.engine.errors import InputError
from kvtool.engine.params import SamplingParams


class TraceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One line of a trace."""

    id: str | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    arrival_s: float | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    cache_salt: str | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, ignore_eos=self.ignore_eos, stop_token_ids=list(self.stop_token_ids),
        )


class TraceLine(msgspec.Struct, kw_only=True):
    """A request with the line it came from."""

    line: int
    request: TraceRequest

    @property
    def name(self) -> str:
        return self.request.id if self.request.id is not None else f"line {self.line}"


_decoder = msgspec.json.Decoder(TraceRequest)


def parse_trace_line(text: str, where: str) -> TraceRequest:
    """Decode and check one line; raises InputError prefixed with `where` (e.g. "trace.jsonl:3")."""
    try:
        req = _decoder.decode(text)
    except msgspec.ValidationError as e:
        raise InputError(f"{where}: {e}") from None
    except msgspec.DecodeError as e:
        raise InputError(f"{where}: malformed JSON ({e})") from None
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise InputError(f"{where}: give exactly one of `prompt` or `prompt_token_ids`")
    if req.prompt is not None and not req.prompt:
        raise InputError(f"{where}: `prompt` is empty")
    if req.prompt_token_ids is not None:
        if not req.prompt_token_ids:
            raise InputError(f"{where}: `prompt_token_ids` is empty")
        bad = next((t for t in req.prompt_token_ids if t < 0), None)
        if bad is not None:
            raise InputError(f"{where}: token id {bad} is negative")
    if req.arrival_s is not None and req.arrival_s < 0:
        raise InputError(f"{where}: arrival_s must be >= 0, got {req.arrival_s}")
    if req.temperature > 0 and req.seed is None:
        raise InputError(
            f"{where}: temperature {req.temperature} without a seed gives outputs that cannot be compared "
            "across arms; add `seed` or use temperature 0"
        )
    try:
        req.sampling()
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return req


def read_trace(path: str | os.PathLike[str]) -> list[TraceLine]:
    """All requests of a trace file, in file order.

    Raises InputError (one line naming the file and line) for a missing or empty file, a
    malformed line, a duplicate `id`, or arrival times that go backwards.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"trace file not found: {path}")
    lines: list[TraceLine] = []
    names: set[str] = set()
    last_arrival = 0.0
    for n, text in enumerate(path.read_text().splitlines(), 1):
        stripped = text.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"{path}:{n}"
        req = parse_trace_line(stripped, where)
        entry = TraceLine(line=n, request=req)
        if entry.name in names:
            raise InputError(f"{where}: request id {entry.name!r} is used twice")
        names.add(entry.name)
        if req.arrival_s is not None:
            if req.arrival_s < last_arrival:
                raise InputError(f"{where}: arrival_s {req.arrival_s} is earlier than a request above it ({last_arrival})")
            last_arrival = req.arrival_s
        lines.append(entry)
    if not lines:
        raise InputError(f"{path}: the trace holds no requests")
    return lines


def encode_trace(requests: list[TraceRequest]) -> str:
    """JSON Lines text for `requests` (default values left out)."""
    encoder = msgspec.json.Encoder()
    return "".join(encoder.encode(r).decode() + "\n" for r in requests)
