"""The per-step messages between scheduler, runner and connector halves.

Every message is a self-contained value: it survives a pickle round trip and shares no list,
tensor or generator with its sender, so the runner (and a connector's worker half) could live in
another process. The runner keeps its own batch state and changes it only from these messages:

    scheduler ──SchedulerOutput──> runner ──ModelRunnerOutput──> scheduler.update_from_output
                 new requests in full          sampled tokens, logprobs,
                 running ones as diffs         KVConnectorOutput (finished jobs, failures)
                 connector metadata

A request the runner has not seen (first admission, or again after a preemption) comes as a
`NewRequestData` with its tokens and sampling; every scheduled request, new or running, comes as
a `ScheduledRequest` with the tokens of this step and the blocks added to its table since the
last message. Finished and preempted ids tell the runner to drop a request's state.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtool.engine.params import SamplingParams


# In a ScheduledRequest's token_ids under async scheduling: the token the request sampled in the
# step still in flight, which the runner takes from its own last sample (on the device).
PLACEHOLDER_TOKEN = -1


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the runner does not know yet, in full (its block table starts empty)."""

    request_id: str
    prompt_token_ids: list[int]
    # Tokens sampled before a preemption (recomputed with the prompt); empty for a new request.
    output_token_ids: list[int]
    sampling: SamplingParams
    # The request's sampling stream: its own seed, or one the engine drew for it at add time.
    seed: int
    # Ids that end it (masked until min_tokens outputs); empty with ignore_eos.
    eos_token_ids: list[int] = []


class ScheduledRequest(msgspec.Struct, kw_only=True):
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step (PLACEHOLDER_TOKEN: the in-flight sample)
    start: int  # absolute position of token_ids[0] (= num_computed_tokens before the step)
    new_block_ids: list[int]  # blocks appended to the request's table since the last message
    sample: bool  # True when this step reaches the end of the known tokens
    # The same for KV cache groups 1.. of a multi-group layout (`kv.groups`), one list each; empty
    # with one group. A table's null entries (block 0: freed by a sliding window, or before a
    # sliding window's hit) come as such; entries freed later are never sent again (the runner
    # masks what lies outside each layer's window).
    new_group_block_ids: list[list[int]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class KVConnectorMetadata(msgspec.Struct, kw_only=True):
    """Scheduler half -> worker half payload of one step. Each connector subclasses it."""


class KVConnectorCompletions(msgspec.Struct, kw_only=True):
    """Worker half -> scheduler half report of finished jobs. Each connector subclasses it."""


class TransferStats(msgspec.Struct, kw_only=True):
    """Worker -> scheduler counters for one step (summed into engine totals)."""

    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    load_failures: int = 0
    # Chunks a step did not store because the store's backlog held every staging buffer.
    store_skipped_chunks: int = 0
    # Per request: tokens actually loaded into / stored out of the pages this step.
    tokens_loaded: dict[str, int] = {}
    tokens_stored: dict[str, int] = {}
    # Of tokens_loaded, those read from a disk tier (the OffloadingConnector's) on the way.
    tokens_loaded_from_disk: dict[str, int] = {}


class KVConnectorOutput(msgspec.Struct, kw_only=True):
    """What the worker half reports after a step."""

    # The step this answers (its SchedulerOutput's step_id); None for a report between steps
    # (completions of background stores taken by a flush).
    step_id: int | None = None
    finished_sending: set[str] = set()
    finished_recving: set[str] = set()
    # Blocks whose external KV failed to load (missing, torn, refused); the scheduler applies the policy.
    invalid_block_ids: set[int] = set()
    # Reasons by block id, for the error message under the `fail` policy.
    invalid_reasons: dict[int, str] = {}
    # Connector-defined completions (store and load job ids, what landed where), by which the
    # scheduler half updates the state it alone owns.
    completions: KVConnectorCompletions | None = None
    stats: TransferStats = msgspec.field(default_factory=TransferStats)


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """What runs in one step."""

    # Numbers the engine's steps from 0, in the order they are scheduled. Under async scheduling
    # step N + 1 is scheduled before step N's output is applied: a connector's scheduler half
    # matches each KVConnectorOutput to the jobs of the step it answers by this id.
    step_id: int = 0
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    connector_meta: KVConnectorMetadata | None = None
    # Structured outputs: request id -> the grammar's allowed-token bitmask for this step's sample
    # (int32 [ceil(V / 32)] on the host), computed by the engine, which owns the grammars.
    allowed_token_bitmasks: dict[str, Any] = {}

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """What the runner reports after a step."""

    sampled: dict[str, int] = {}  # request id -> sampled token id
    logprobs: dict[str, dict[int, float]] = {}  # request id -> {token id: logprob} (sampled + top-n)
    connector_output: KVConnectorOutput | None = None
