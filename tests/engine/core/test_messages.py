"""The engine's seams are self-contained messages.

Every step's SchedulerOutput is pickled and unpickled before the runner sees it, and every
ModelRunnerOutput before the scheduler sees it: an engine driven only by those copies gives the
same tokens and logprobs as one driven directly, through chunked prefill, prefix-cache hits,
preemptions, seeded sampling with logprobs and an OffloadingConnector's loads and stores.
"""

import pickle

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([90, 33, 130, 90, 17, 64])]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=11, logprobs=1),
    SamplingParams(max_tokens=14, temperature=1.0, top_k=20),
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=8, temperature=0.7, seed=5, logprobs=0),
    SamplingParams(max_tokens=10, temperature=0.0, logprobs=3),
]


def drive_through_copies(engine) -> list:
    """Make `engine` exchange only pickled copies between its scheduler and its runner."""
    seen = []
    execute = engine.executor.execute

    def execute_copy(so):
        wire = pickle.dumps(so)
        seen.append(len(wire))
        out = execute(pickle.loads(wire))
        return pickle.loads(pickle.dumps(out))

    engine.executor.execute = execute_copy
    return seen


def run(engine, repeat: int = 3):
    results = []
    for i in range(repeat):  # later rounds load from the connector's tier, then hit the prefix cache
        results.append(engine.generate(PROMPTS, PARAMS))
        if i == 0:
            engine.reset_prefix_cache()
    return [[(r.output_token_ids, r.logprobs, r.finish_reason) for r in rs] for rs in results]


def test_copies_of_every_message_drive_the_engine_identically(make_engine):
    # A CPU tier only: its stores are synchronous on CPU, so both engines see the same hits.
    config = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"num_cpu_blocks":24}}'
    # Few KV blocks and a small token budget: chunked prefill and preemptions happen.
    small = dict(num_gpu_blocks=22, max_num_batched_tokens=64)
    direct = run(make_engine(**small, kv_transfer_config=parse_kv_transfer_config(config)))
    copied_engine = make_engine(**small, kv_transfer_config=parse_kv_transfer_config(config))
    wire_sizes = drive_through_copies(copied_engine)
    copied = run(copied_engine)
    assert wire_sizes, "the runner was not driven through copies"
    assert copied_engine.stats().num_preemptions > 0 and copied_engine.stats().external_tokens_loaded > 0
    assert copied == direct


def test_running_requests_travel_as_diffs(make_engine):
    """A decode step names one token and only the blocks added since the last message."""
    engine = make_engine(block_size=16)
    messages = []
    execute = engine.executor.execute

    def record(so):
        messages.append(pickle.loads(pickle.dumps(so)))
        return execute(so)

    engine.executor.execute = record
    engine.generate([list(range(1, 40))], SamplingParams(max_tokens=30, temperature=0.0))
    first, later = messages[0], messages[1:]
    assert [n.request_id for n in first.new_requests] == ["req-0"]
    assert first.scheduled[0].new_block_ids and len(first.scheduled[0].token_ids) == 39
    assert all(not m.new_requests for m in later)
    assert all(len(m.scheduled[0].token_ids) == 1 for m in later if m.scheduled)
    sent = [len(m.scheduled[0].new_block_ids) for m in later if m.scheduled]
    # 39 + 30 tokens need 5 blocks of 16: 3 at the start, then one each time a block fills up.
    assert sum(sent) + len(first.scheduled[0].new_block_ids) == 5 and max(sent) == 1
    assert messages[-1].finished_req_ids == [] and engine.executor.request_ids == ["req-0"]
    engine.step() if engine.has_unfinished_requests() else None
