"""The CUDA batch-invariance check the architecture tests share: a request's tokens and logprobs
alone equal those it gets batched with others, with decode graphs replayed."""

from __future__ import annotations

from kvtool.engine.params import SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def tokens(n: int, seed: int) -> list[int]:
    return [(i * 37 + 11 * seed) % 250 + 3 for i in range(n)]


TARGETS = [tokens(300, 2), tokens(45, 3)]


def alone_equals_batched(engine) -> None:
    """TARGETS alone, then at the end of batches of 3 and 20 other prompts: the same results."""
    alone = [(r.output_token_ids, r.logprobs) for r in engine.generate(TARGETS, SP)]
    for n in (3, 20):
        others = [tokens(20 + (i * 97) % 700, 10 + i) for i in range(n)]
        batch = engine.generate(others + TARGETS, SP)
        assert [(r.output_token_ids, r.logprobs) for r in batch[-2:]] == alone, n
    graphs = engine.executor.worker.runner.graphs
    assert graphs is not None and sum(graphs.replays.values()), "no decode step replayed a graph"


def cuda_model_is_batch_invariant(model_dir, check_engine=None) -> None:
    """`alone_equals_batched` on an engine of `model_dir` on CUDA (bf16, batch-invariant, no prefix
    cache); `check_engine(engine)` first, when given."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    engine = LLMEngine(EngineParams(model=str(model_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=400,
                                    max_model_len=2000, batch_invariant=True, enable_prefix_caching=False))
    try:
        if check_engine is not None:
            check_engine(engine)
        alone_equals_batched(engine)
    finally:
        engine.close()
