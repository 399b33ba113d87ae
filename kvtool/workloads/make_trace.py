"""Generators for common trace shapes, so that nobody writes a trace by hand.

    multi-turn      users chatting (vLLM's benchmarks/multi_turn, LMCache's multi-round QA):
                    every turn repeats the whole history (the system prompt all users share, the
                    user's own context of `history_len`, earlier user turns and stand-in
                    answers) before a new user message; with `think_time_s`, each turn carries
                    the time it is sent: users start at random within one think time, and a
                    user's next turn follows its previous one by 0.5 to 1.5 think times (open
                    loop: it is sent then whether or not the answer has come back), the trace
                    in the order of those times; without it, turn by turn (every user's turn 0,
                    then every user's turn 1, ...)
    long-doc-qa     documents (LMCache's long-doc QA), each asked several questions (document +
                    question); `doc_len` tokens each, or drawn uniformly in [doc_len,
                    doc_len_max]; `repeat_mode` orders the questions: tile (every document once,
                    then every document again: the longest reuse distance), interleave (a
                    document's questions back to back) or random (shuffled by the seed)
    shared-prefix   a few shared prefixes, each followed by many different suffixes

Prompts are token ids (`fmt="ids"`: lengths are exact token counts, ids drawn from printable
ASCII codes 32..126, valid in any vocabulary of 127 ids or more) or text (`fmt="text"`: lengths
count words, the model's tokenizer decides the tokens). The same seed gives the same trace.
Without a request rate or think time, requests carry no `arrival_s` and run one after another;
with a rate, request i arrives at i / rate seconds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

import msgspec

from kvtool.engine.errors import InputError
from kvtool.workloads.trace import TraceRequest

TraceKind = Literal["multi-turn", "long-doc-qa", "shared-prefix"]
TRACE_KINDS: tuple[str, ...] = ("multi-turn", "long-doc-qa", "shared-prefix")
PromptFormat = Literal["ids", "text"]
RepeatMode = Literal["tile", "interleave", "random"]
REPEAT_MODES: tuple[str, ...] = ("tile", "interleave", "random")

_WORDS = (
    "the cache keeps blocks of keys and values near the model so that a long prompt seen before "
    "costs a copy instead of a prefill while every byte is checked against the engine that wrote it "
    "disk memory remote store chunk layer token request answer question document context reuse "
    "offload latency first output greedy seed prefix suffix batch page tier server client trace"
).split()


class TraceShape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every knob of the generators; each kind reads the ones it names."""

    kind: TraceKind
    fmt: PromptFormat = "ids"
    seed: int = 0
    max_tokens: int = 16
    request_rate: float | None = None  # requests per second; None = one after another
    # multi-turn
    num_conversations: int = 4
    num_turns: int = 3
    system_len: int = 64
    history_len: int = 0  # each user's own context after the system prompt
    turn_len: int = 32
    answer_len: int = 16
    think_time_s: float = 0.0  # mean seconds between a user's turns; 0 = no timeline
    # long-doc-qa
    num_docs: int = 2
    doc_len: int = 256
    doc_len_max: int | None = None  # lengths drawn uniformly in [doc_len, doc_len_max]
    num_questions: int = 3
    question_len: int = 16
    repeat_mode: RepeatMode = "tile"
    # shared-prefix
    num_prefixes: int = 2
    prefix_len: int = 128
    num_requests: int = 8
    suffix_len: int = 32


class _Segments:
    """Random segments in one format: lists of ids, or text joined with separators."""

    def __init__(self, fmt: PromptFormat, rng: random.Random) -> None:
        self.fmt = fmt
        self.rng = rng

    def make(self, length: int) -> list:
        if self.fmt == "ids":
            return [self.rng.randrange(32, 127) for _ in range(length)]
        return [" ".join(self.rng.choice(_WORDS) for _ in range(length))]

    def labelled(self, label: str, length: int) -> list:
        if length == 0:
            return []
        body = self.make(length)
        return body if self.fmt == "ids" else [f"{label}: {body[0]}"]


def _request(parts: list, fmt: PromptFormat, name: str, shape: TraceShape) -> TraceRequest:
    if fmt == "ids":
        return TraceRequest(id=name, prompt_token_ids=list(parts), max_tokens=shape.max_tokens)
    return TraceRequest(id=name, prompt="\n\n".join(parts), max_tokens=shape.max_tokens)


def _multi_turn(shape: TraceShape, seg: _Segments) -> list[TraceRequest]:
    system = seg.labelled("System", shape.system_len)
    histories = [list(system) + seg.labelled("Context", shape.history_len) for _ in range(shape.num_conversations)]
    out = []
    for t in range(shape.num_turns):
        for c in range(shape.num_conversations):
            if t > 0:
                histories[c] += seg.labelled("Assistant", shape.answer_len)
            histories[c] += seg.labelled("User", shape.turn_len)
            out.append(_request(histories[c], shape.fmt, f"conv{c}-turn{t}", shape))
    if shape.think_time_s > 0:
        out = _on_a_timeline(out, shape, seg.rng)
    return out


def _on_a_timeline(turn_major: list[TraceRequest], shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    """The requests with the times users send them, in the order of those times."""
    think, n = shape.think_time_s, shape.num_conversations
    sent_at = [rng.uniform(0.0, think) for _ in range(n)]
    timed = []
    for i, req in enumerate(turn_major):
        t, c = divmod(i, n)
        if t > 0:
            sent_at[c] += think * rng.uniform(0.5, 1.5)
        timed.append((round(sent_at[c], 6), t, c, req))
    timed.sort(key=lambda x: x[:3])
    return [msgspec.structs.replace(req, arrival_s=at) for at, _, _, req in timed]


def _long_doc_qa(shape: TraceShape, seg: _Segments) -> list[TraceRequest]:
    lengths = [shape.doc_len] * shape.num_docs
    if shape.doc_len_max is not None:
        lengths = [seg.rng.randint(shape.doc_len, shape.doc_len_max) for _ in range(shape.num_docs)]
    docs = [seg.labelled("Document", n) for n in lengths]
    asked = [[_request(doc + seg.labelled("Question", shape.question_len), shape.fmt, f"doc{d}-q{q}", shape)
              for d, doc in enumerate(docs)] for q in range(shape.num_questions)]
    if shape.repeat_mode == "interleave":
        return [asked[q][d] for d in range(shape.num_docs) for q in range(shape.num_questions)]
    out = [r for per_question in asked for r in per_question]
    if shape.repeat_mode == "random":
        seg.rng.shuffle(out)
    return out


def _shared_prefix(shape: TraceShape, seg: _Segments) -> list[TraceRequest]:
    prefixes = [seg.labelled("Context", shape.prefix_len) for _ in range(shape.num_prefixes)]
    out = []
    for i in range(shape.num_requests):
        p = i % shape.num_prefixes
        out.append(_request(prefixes[p] + seg.labelled("Request", shape.suffix_len), shape.fmt, f"p{p}-r{i}", shape))
    return out


_GENERATORS: dict[str, Callable[[TraceShape, _Segments], list[TraceRequest]]] = {
    "multi-turn": _multi_turn,
    "long-doc-qa": _long_doc_qa,
    "shared-prefix": _shared_prefix,
}


def refuse_bad_shape(shape: TraceShape) -> None:
    """Raise InputError naming the first knob that cannot make a trace."""
    for name in (
        "max_tokens", "num_conversations", "num_turns", "turn_len", "num_docs", "doc_len", "num_questions",
        "question_len", "num_prefixes", "prefix_len", "num_requests", "suffix_len",
    ):
        if getattr(shape, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(shape, name)}")
    for name in ("system_len", "history_len", "answer_len"):
        if getattr(shape, name) < 0:
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(shape, name)}")
    if shape.request_rate is not None and shape.request_rate <= 0:
        raise InputError(f"--request-rate must be positive, got {shape.request_rate}")
    if not 0 <= shape.think_time_s < float("inf"):
        raise InputError(f"--think-time must be >= 0 seconds, got {shape.think_time_s}")
    if shape.think_time_s > 0 and shape.request_rate is not None:
        raise InputError("give --think-time or --request-rate, not both: each sets the requests' arrival times")
    if shape.doc_len_max is not None and shape.doc_len_max < shape.doc_len:
        raise InputError(f"--doc-len LOW,HIGH needs LOW <= HIGH, got {shape.doc_len},{shape.doc_len_max}")


def make_trace(shape: TraceShape) -> list[TraceRequest]:
    """The requests of a trace of `shape`, in the order they are sent. Raises InputError for bad knobs."""
    refuse_bad_shape(shape)
    seg = _Segments(shape.fmt, random.Random(f"{shape.kind}:{shape.seed}"))
    requests = _GENERATORS[shape.kind](shape, seg)
    if shape.request_rate is not None:
        requests = [
            msgspec.structs.replace(r, arrival_s=round(i / shape.request_rate, 6)) for i, r in enumerate(requests)
        ]
    return requests
