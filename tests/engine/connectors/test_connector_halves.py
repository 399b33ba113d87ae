"""The OffloadingConnector's halves share nothing and the scheduling path does no I/O.

* Each half is built in a process of its own, without the other: the scheduler half answers a
  lookup from its disk index and plans a load; the worker half, in another process, runs that
  plan from a pickled copy, fills the pages with the block's bytes and reports the job finished.
* schedule() makes no file-system or socket call, with a disk tier whose files it must find.
"""

import builtins
import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams
from tests.conftest import REPO

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
PROMPT = [(5 * i) % 400 + 1 for i in range(70)]


def offload(root) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"num_cpu_blocks": 8, "root_dir": str(root)}})


HALF_SCRIPT = textwrap.dedent(
    """
    import pickle, sys, time
    import torch
    from kvtool.engine.connectors.base import ConnectorContext
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.connectors.registry import resolve_connector
    from kvtool.engine.core.hashing import extend_block_hashes, make_none_hash
    from kvtool.engine.core.messages import KVConnectorOutput, ScheduledRequest, SchedulerOutput
    from kvtool.engine.core.request import Request
    from kvtool.engine.kv.identity import identity_for_model
    from kvtool.engine.kv.pages import KVPages
    from kvtool.engine.params import EngineParams, SamplingParams

    role, model, config, prompt_file, io_file = sys.argv[1:]
    params = EngineParams(model=model, device="cpu", kv_transfer_config=parse_kv_transfer_config(config))
    ctx = ConnectorContext(config=params.kv_transfer_config, identity=identity_for_model(model, params),
                           none_hash=make_none_hash())
    connector = resolve_connector(params.kv_transfer_config)
    if role == "scheduler":
        half = connector.create_scheduler_half(ctx)
        assert not hasattr(half, "pool") and not hasattr(half, "disk_tier") and not hasattr(half, "_pool")
        prompt = [int(t) for t in open(prompt_file).read().split()]
        req = Request("r", prompt, SamplingParams(max_tokens=1), max_tokens=1, eos_token_ids=frozenset())
        extend_block_hashes(req.block_hashes, req.all_token_ids, 16, ctx.none_hash, None)
        half.check_request(req)
        deadline = time.monotonic() + 30
        while (matched := half.get_num_new_matched_tokens(req, 0)[0]) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # an asynchronous lookup: asked again, as the scheduler does
        req.block_ids = list(range(10, 10 + len(req.block_hashes) + 1))
        half.update_state_after_alloc(req, req.block_ids, matched)
        so = SchedulerOutput(scheduled=[ScheduledRequest(request_id="r", token_ids=prompt[matched:], start=matched,
                                                         new_block_ids=req.block_ids, sample=True)])
        meta = half.build_connector_meta(so)
        pinned = half.slots.num_pinned if hasattr(half, "slots") else len(meta.loads)
        with open(io_file, "wb") as f:
            pickle.dump((matched, meta), f)
        half.shutdown()
        print(matched, pinned, len(meta.loads))
    else:
        half = connector.create_worker_half(ctx)
        assert not hasattr(half, "slots") and not hasattr(half, "requests") and not hasattr(half, "lookups")
        with open(io_file, "rb") as f:
            matched, meta = pickle.load(f)
        pages = KVPages(ctx.identity.geometry, 40, torch.device("cpu"))
        pages.tensor.zero_()
        half.register_kv_caches(pages)
        half.bind_connector_metadata(meta)
        half.start_load_kv()
        errors = half.get_block_ids_with_load_errors()
        done = half.take_completions()
        filled = sum(int(pages.tensor[b].abs().sum() > 0) for job in meta.loads for b in job.block_ids)
        half.shutdown()
        reported = done is None or sorted(done.finished_job_ids) == sorted(j.job_id for j in meta.loads)
        print(len(errors), reported, filled)
    """
)


def run_halves(config: str, prompt: list[int], tiny_model_dir, cli_env, tmp_path):
    """Each half in a subprocess of its own: the scheduler half plans, the worker half loads."""
    prompt_file, io_file, script = tmp_path / "prompt.txt", tmp_path / "plan.pkl", tmp_path / "half.py"
    prompt_file.write_text(" ".join(map(str, prompt)))
    script.write_text(HALF_SCRIPT)

    def half(role):
        r = subprocess.run([sys.executable, str(script), role, str(tiny_model_dir), config, str(prompt_file),
                            str(io_file)], env=cli_env, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr
        return [int(x) if x.isdigit() else x for x in r.stdout.split()]

    return half("scheduler"), half("worker")


def test_each_offloading_half_runs_in_a_process_of_its_own(make_engine, tiny_model_dir, cli_env, tmp_path):
    root = tmp_path / "tier"
    writer = make_engine(kv_transfer_config=parse_kv_transfer_config(offload(root)))
    writer.generate([PROMPT], GREEDY)
    writer.executor.worker.connector.flush()
    (matched, pinned, num_loads), (errors, reported, filled) = run_halves(offload(root), PROMPT, tiny_model_dir,
                                                                           cli_env, tmp_path)
    assert matched == 64 and num_loads == 4 and pinned == 4  # 4 offload blocks, from disk
    assert errors == 0 and reported == "True" and filled == 4


def lmcache(server) -> str:
    return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"host": server.host, "port": server.port}})


LONG_PROMPT = [(7 * i) % 400 + 1 for i in range(70)]


def test_each_lmcache_half_runs_in_a_process_of_its_own(make_engine, lmcache_server, tiny_model_dir, cli_env, tmp_path):
    writer = make_engine(kv_transfer_config=parse_kv_transfer_config(lmcache(lmcache_server)))
    writer.generate([LONG_PROMPT], GREEDY)
    writer.executor.worker.connector.flush()
    (matched, _, num_loads), (errors, reported, filled) = run_halves(lmcache(lmcache_server), LONG_PROMPT,
                                                                      tiny_model_dir, cli_env, tmp_path)
    assert matched == 64 and num_loads == 4  # four 16-token chunks (blake3 keys: one per block)
    assert errors == 0 and reported == "True" and filled == 4


def test_lmcache_schedule_makes_no_socket_call(make_engine, lmcache_server):
    config = parse_kv_transfer_config(lmcache(lmcache_server))
    writer = make_engine(kv_transfer_config=config)
    writer.generate([LONG_PROMPT], GREEDY)
    writer.flush_connector()
    engine = make_engine(kv_transfer_config=config)
    calls = watch_schedule(engine)
    result = engine.generate([LONG_PROMPT], GREEDY)[0]
    assert result.stats.num_external_tokens == 64 and result.stats.num_external_loaded_tokens == 64
    assert calls == []


def watch_schedule(engine) -> list:
    """Make every engine.scheduler.schedule() record its file and socket calls into the list returned."""
    calls: list = []
    schedule = engine.scheduler.schedule

    def watched():
        with no_io(calls):
            return schedule()

    engine.scheduler.schedule = watched
    return calls


@contextlib.contextmanager
def no_io(calls: list):
    """Record every file-system and socket call the calling thread makes inside the block
    (background threads, such as a connector's lookup thread, may do I/O: that is their job)."""
    patched = []
    me = threading.get_ident()

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            if threading.get_ident() == me:
                calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return real(*a, **k)

        patched.append((owner, name, real))
        setattr(owner, name, wrapper)

    for name in ("stat", "lstat", "open", "scandir", "listdir", "access", "utime", "read", "pread", "write"):
        spy(os, name)
    spy(builtins, "open")
    for name in ("connect", "send", "sendall", "recv", "recv_into"):
        spy(socket.socket, name)
    try:
        yield
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


@pytest.mark.parametrize("restart", [False, True])
def test_schedule_makes_no_io_call(make_engine, tmp_path, restart):
    root = tmp_path / "tier"
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(offload(root)))
    engine.generate([PROMPT], GREEDY)
    engine.executor.worker.connector.flush()
    if restart:  # a new engine finds the blocks through the index it built at start-up
        engine = make_engine(kv_transfer_config=parse_kv_transfer_config(offload(root)))
    else:
        engine.reset_prefix_cache()
        engine.step() if engine.has_unfinished_requests() else None
    engine.add_request(PROMPT, GREEDY)
    calls = watch_schedule(engine)
    while engine.has_unfinished_requests():
        engine.step()
    result = engine.pop_result("req-1" if not restart else "req-0")
    assert result.stats.num_external_tokens == 64 and result.stats.num_external_loaded_tokens == 64
    assert calls == []
