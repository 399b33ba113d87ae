"""The engine loop reports each inter-token gap as the step that ends it is dispatched, as vLLM
observes `vllm:inter_token_latency_seconds`: one per output after a request's first, not a mean
recorded when the request ends."""

import asyncio

from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.server.engine_loop import EngineLoop, EventSink, Finished, GenerationJob


def test_each_gap_is_reported_while_its_request_runs(tiny_model_dir):
    events: list[tuple[str, float]] = []
    engine = LLMEngine(EngineParams(model=str(tiny_model_dir), device="cpu", kv_cache_memory=64 << 20))
    loop = EngineLoop(engine, on_finished=lambda r: events.append(("finished", len(r.output_token_ids))),
                      on_token_gap=lambda s: events.append(("gap", s)))

    async def run() -> None:
        sink = EventSink()
        loop.add(GenerationJob("r", list(range(5, 25)), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                               stream=True), sink)
        while not isinstance(await sink.get(), Finished):
            pass

    loop.start()
    try:
        asyncio.run(run())
    finally:
        loop.shutdown(60)
    assert [kind for kind, _ in events] == ["gap"] * 8 + ["finished"]
    assert events[-1] == ("finished", 9)
    assert all(gap > 0 for _, gap in events[:-1])
