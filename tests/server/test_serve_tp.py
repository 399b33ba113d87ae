"""`kvtool serve --tensor-parallel-size 2` on CPU (2 gloo ranks in worker processes): the official
`openai` client gets the same tokens as from `--tensor-parallel-size 1`; SIGTERM ends it with
status 0 and no process left; a killed worker stops it with one line naming the rank; a killed
server takes its workers with it.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.support.process_tree import descendants, wait_gone
from tests.support.server_process import ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FLAGS = ["--device", "cpu", "--max-model-len", "256", "--kv-cache-memory", "64M"]


def _answers(server: ServerProcess) -> list[tuple[list[int], str]]:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        out.append(((choice.model_extra or {}).get("token_ids"), choice.text))
    return out


def _worker_pids(server: ServerProcess) -> list[int]:
    pids = descendants(server.pid)
    assert len(pids) >= 2, f"expected the 2 rank processes below the server, found {pids}"
    return pids


def test_tp2_serves_tp1_s_tokens_and_stops_cleanly_on_sigterm(tiny_model_dir):
    with ServerProcess([str(tiny_model_dir), *FLAGS]) as tp1:
        expected = _answers(tp1)
    assert all(ids for ids, _ in expected)
    server = ServerProcess([str(tiny_model_dir), *FLAGS, "--tensor-parallel-size", "2"]).start()
    try:
        children = _worker_pids(server)
        assert _answers(server) == expected
    finally:
        status = server.stop(signal.SIGTERM)
    assert status == 0, server.logs()[-3000:]
    assert wait_gone(children) == []
    assert "Traceback" not in server.logs()


def test_a_killed_worker_stops_the_server_with_one_line_naming_its_rank(tiny_model_dir):
    server = ServerProcess([str(tiny_model_dir), *FLAGS, "-tp", "2"]).start()
    try:
        children = _worker_pids(server)
        os.kill(_rank_pid(server, 1), signal.SIGKILL)
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIError):
            client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=4)
        status = server.proc.wait(60)
    finally:
        server.kill()
    assert status == 1
    logs = server.logs()
    assert "error: tensor-parallel worker rank 1 died (signal 9, SIGKILL)" in logs.splitlines(), logs[-3000:]
    assert "Traceback" not in logs
    assert wait_gone(children) == []


def test_a_killed_server_takes_its_workers_with_it(tiny_model_dir):
    server = ServerProcess([str(tiny_model_dir), *FLAGS, "-tp", "2"]).start()
    try:
        children = _worker_pids(server)
    finally:
        server.kill()  # SIGKILL: no clean-up of its own runs
    assert wait_gone(children) == []


def _rank_pid(server: ServerProcess, rank: int) -> int:
    """The worker process of `rank` (each names itself kvtool-tp-rank<R>)."""
    for pid in descendants(server.pid):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == f"kvtool-tp-rank{rank}":
                    return pid
        except OSError:
            continue
    raise AssertionError(f"no process of rank {rank} below the server")
