"""Two `kvtool serve` replicas behind vLLM's router (`vllm-router`) with its cache-aware policy.

The cache-aware policy keeps, per worker, a prefix tree of the request texts it sent there: a
request whose text mostly matches a worker's tree goes to that worker, any other to the least
loaded one. The workload opens a long stream with prefix A (so its replica is busy), then sends
prefix B (it lands on the other, idle replica), then more requests with each prefix: each must
land where its prefix is cached, which the replicas' own /metrics show (prefix-cache hit tokens
and requests per replica), and every output must be the one a single replica gives.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support.router_process import RouterProcess
from tests.support.server_process import ServerProcess

MODEL = "tiny"
PREFIX_A = "The quick brown fox jumps over the lazy dog near the river bank. " * 4
PREFIX_B = "Lorem ipsum dolor sit amet, consectetur adipiscing elit; sed do eiusmod tempor. " * 4
ROUNDS = 3


def _serve_flags(model_dir) -> list[str]:
    return ["--model", str(model_dir), "--served-model-name", MODEL, "--device", "cpu", "--kv-cache-memory", "64M"]


def _complete(client: openai.OpenAI, prompt: str) -> tuple[str, int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _counts(server: ServerProcess) -> tuple[float, float]:
    m = server.metrics()
    return m["kvtool:requests_total"], m["vllm:prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    with ServerProcess(_serve_flags(tiny_model_dir)) as a, ServerProcess(_serve_flags(tiny_model_dir)) as b:
        yield a, b


def test_shared_prefixes_land_where_they_are_cached(replicas, tiny_model_dir):
    a, b = replicas
    prompts = [(p, p + f"Question {i}: what comes next?") for i in range(1, ROUNDS + 1) for p in (PREFIX_A, PREFIX_B)]
    with ServerProcess(_serve_flags(tiny_model_dir)) as single:
        reference = {prompt: _complete(openai.OpenAI(base_url=single.base_url, api_key="unused"), prompt)[0]
                     for _, prompt in prompts}

    before = {s.url: _counts(s) for s in replicas}
    with RouterProcess([a.url, b.url], policy="cache_aware") as router:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        # A long stream with prefix A keeps its replica loaded while prefix B is routed: B's text
        # matches no tree, so it goes to the least loaded replica, the other one.
        stream = client.completions.create(model=MODEL, prompt=PREFIX_A + "Question 0:", max_tokens=2000,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        first_b = _complete(client, PREFIX_B + "Question 0:")
        stream.close()
        results = {prompt: _complete(client, prompt) for _, prompt in prompts}

    assert first_b[1] == 0
    for prompt, (text, cached) in results.items():
        assert text == reference[prompt], prompt
        assert cached >= 16 * (min(len(PREFIX_A), len(PREFIX_B)) // 16 - 1), (prompt, cached)
    hits_a = sum(cached for (prefix, prompt) in prompts if prefix == PREFIX_A for cached in [results[prompt][1]])
    hits_b = sum(cached for (prefix, prompt) in prompts if prefix == PREFIX_B for cached in [results[prompt][1]])
    after = {s.url: _counts(s) for s in replicas}
    delta = {url: (after[url][0] - before[url][0], after[url][1] - before[url][1]) for url in after}
    # Each replica served one prefix: the stream (or B's first request) plus ROUNDS requests,
    # and all of its hit tokens are that prefix's.
    assert sorted(delta.values()) == sorted([(ROUNDS + 1.0, float(hits_a)), (ROUNDS + 1.0, float(hits_b))]), delta
    assert hits_a != hits_b


def test_worker_routes_the_router_uses(replicas):
    a, _ = replicas
    tok = httpx.post(f"{a.url}/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0 and tok["token_strs"] is None
    chat = httpx.post(f"{a.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "return_token_strs": True}, timeout=30).json()
    assert len(chat["token_strs"]) == chat["count"] > tok["count"]
    back = httpx.post(f"{a.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert back == {"prompt": "hello"}
    wrong = httpx.post(f"{a.url}/tokenize", json={"model": "other", "prompt": "hello"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found"

    # The router's own defaults for fields kvtool does not take are accepted; other values are not.
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0, "no_stop_trim": False,
            "skip_special_tokens": True, "return_hidden_states": False}
    plain = httpx.post(f"{a.url}/v1/completions", json={k: body[k] for k in ("model", "prompt", "max_tokens", "temperature")},
                       timeout=60).json()
    assert httpx.post(f"{a.url}/v1/completions", json=body, timeout=60).json()["choices"] == plain["choices"]
    refused = httpx.post(f"{a.url}/v1/completions", json={**body, "no_stop_trim": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "no_stop_trim"
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                 "continue_final_message": False, "separate_reasoning": True, "include_reasoning": True}
    assert httpx.post(f"{a.url}/v1/chat/completions", json=chat_body, timeout=60).status_code == 200


class EventForwarder:
    """A zmq forwarder on loopback between one replica's KV event PUB and the router's SUB.

    vLLM's endpoint rule makes a publisher bind only on a wildcard host (every interface); one
    that names 127.0.0.1 connects. So the replica connects to this forwarder's XSUB side and the
    router to its XPUB side, both bound on 127.0.0.1. Every batch that passes is also copied to a
    capture socket, so the test knows which sequence numbers have been handed to the router.
    """

    def __init__(self) -> None:
        import threading

        import zmq

        self.ctx = zmq.Context()
        self.frontend = self.ctx.socket(zmq.XSUB)
        self.frontend.bind("tcp://127.0.0.1:*")
        self.backend = self.ctx.socket(zmq.XPUB)
        self.backend.bind("tcp://127.0.0.1:*")
        self.capture_out = self.ctx.socket(zmq.PAIR)
        self.capture_out.bind("inproc://capture")
        self.captured = self.ctx.socket(zmq.PAIR)
        self.captured.connect("inproc://capture")
        self.control = self.ctx.socket(zmq.PAIR)
        self.control.bind("inproc://control")
        control_in = self.ctx.socket(zmq.PAIR)
        control_in.connect("inproc://control")
        self.publisher_side = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.subscriber_side = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.thread = threading.Thread(
            target=zmq.proxy_steerable, args=(self.frontend, self.backend, self.capture_out, control_in), daemon=True
        )
        self._control_in = control_in
        self.thread.start()

    def wait_for_seq(self, seq: int, timeout_ms: int = 60_000) -> None:
        """Block until batch `seq` (or a later one) went through to the router."""
        while True:
            if not self.captured.poll(timeout_ms):
                raise AssertionError(f"no KV event batch {seq} reached the forwarder")
            frames = self.captured.recv_multipart()
            if len(frames) == 3 and int.from_bytes(frames[1], "big") >= seq:
                return

    def close(self) -> None:
        self.control.send(b"TERMINATE")
        self.thread.join(30)
        for sock in (self.frontend, self.backend, self.capture_out, self.captured, self.control, self._control_in):
            sock.close(linger=0)
        self.ctx.term()


def test_kv_aware_routes_on_kvtool_kv_events(tiny_model_dir):
    """The router's kv_aware policy follows each replica's cache from kvtool's KV events alone.

    Each prefix is sent straight to one replica, past the router: only the replicas' events can
    tell the router where it is cached. Requests through the router must then land there.
    """
    from tests.support.peer_server import free_port

    forwarders = [EventForwarder(), EventForwarder()]
    replay_ports = [free_port(), free_port()]
    servers = []
    try:
        for fwd, port in zip(forwarders, replay_ports):
            events = {"enable_kv_cache_events": True, "endpoint": fwd.publisher_side,
                      "replay_endpoint": f"tcp://127.0.0.1:{port}"}
            servers.append(ServerProcess([*_serve_flags(tiny_model_dir), "--kv-events-config", json.dumps(events)]).start())
        sources = []
        for server, fwd, port in zip(servers, forwarders, replay_ports):
            sources += ["--kv-event-source", f"{server.url}={fwd.subscriber_side}",
                        "--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{port}"]
        with RouterProcess([s.url for s in servers], policy="kv_aware",
                           extra=[*sources, "--kv-event-block-size", "16", "--kv-event-model", MODEL]) as router:
            client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
            # Every replica's first batch (seq 0) reaches the router: the subscriptions are up.
            for server, fwd in zip(servers, forwarders):
                _complete(openai.OpenAI(base_url=server.base_url, api_key="unused"), "one block of sixteen bytes!")
                fwd.wait_for_seq(0)
            for server, fwd, prefix in zip(servers, forwarders, (PREFIX_A, PREFIX_B)):
                _complete(openai.OpenAI(base_url=server.base_url, api_key="unused"), prefix + "Question 0:")
                fwd.wait_for_seq(1)
            # A request through the router too short for one block: by its end the router has
            # taken in what the forwarders handed it.
            _complete(client, "hi")
            before = [_counts(s) for s in servers]
            results = [(prefix, _complete(client, prefix + f"Question {i}: what comes next?"))
                       for i in range(1, ROUNDS + 1) for prefix in (PREFIX_A, PREFIX_B)]
            after = [_counts(s) for s in servers]
            decisions = [line for line in router.logs().splitlines() if "KV prefix decision" in line]
    finally:
        for server in servers:
            server.stop()
        for fwd in forwarders:
            fwd.close()

    for prefix, (_, cached) in results:
        assert cached >= 16 * (len(prefix) // 16), (prefix[:20], cached)
    hits = [sum(c for p, (_, c) in results if p == prefix) for prefix in (PREFIX_A, PREFIX_B)]
    assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)] == [(ROUNDS, hits[0]), (ROUNDS, hits[1])]
    assert len(decisions) >= 2 * ROUNDS and all("credited_prefix_tokens=0 " not in d for d in decisions[-2 * ROUNDS:])
