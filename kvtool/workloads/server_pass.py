"""One pass of a trace against a running OpenAI-compatible server (`kvtool serve`, vLLM, ...).

Requests go to POST /v1/completions with the prompt as token ids, streamed, so that TTFT is the
time to the first chunk that carries output. For token-level comparison the request asks for
`return_token_ids` (a vLLM extra that `kvtool serve` implements); a server that refuses it is
compared on text instead, and the report says so. The hit proof is the usage's
`prompt_tokens_details.cached_tokens` (the local prefix cache and the connector together: the
API does not tell them apart); when the server exposes kvtool's /metrics, the pass also gets the
connector's loaded tokens and bytes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx

from kvtool.engine.errors import ConfigError, PeerError
from kvtool.workloads.trace_pass import PassRequest, PassResult, RequestRecord

Progress = Callable[[str, float], None]
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServerTarget:
    """A server that passes run against; `connect` finds its model and whether it returns ids."""

    def __init__(self, base_url: str, model: str, returns_token_ids: bool) -> None:
        self.base_url = base_url
        self.model = model
        self.returns_token_ids = returns_token_ids

    @classmethod
    def connect(cls, url: str, probe_token_id: int) -> ServerTarget:
        """Ask /v1/models for the model and probe `return_token_ids` with a one-token request.

        Raises ConfigError for a URL that is not http(s), PeerError when the server cannot be
        reached or answers the probe with an error other than refusing the field.
        """
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--server must be an http:// or https:// URL, got {url!r}")
        base = _base_url(url)
        try:
            with httpx.Client(timeout=TIMEOUT) as client:
                models = client.get(f"{base}/v1/models")
                if models.status_code != 200:
                    raise PeerError(f"{base}/v1/models answered {models.status_code}: {models.text[:200]}")
                data = models.json().get("data") or []
                if not data:
                    raise PeerError(f"{base}/v1/models lists no model")
                model = data[0]["id"]
                body = {"model": model, "prompt": [probe_token_id], "max_tokens": 1, "temperature": 0.0,
                        "return_token_ids": True}
                probe = client.post(f"{base}/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise PeerError(f"cannot reach the server at {base}: {e}") from None
        if probe.status_code == 200:
            choice = probe.json()["choices"][0]
            return cls(base, model, returns_token_ids=choice.get("token_ids") is not None)
        if probe.status_code == 400 and "return_token_ids" in probe.text:
            return cls(base, model, returns_token_ids=False)
        raise PeerError(f"{base}/v1/completions answered {probe.status_code}: {probe.text[:200]}")

    def read_metrics(self) -> dict[str, float] | None:
        """kvtool's connector counters from /metrics, or None when the server has none."""
        try:
            resp = httpx.get(f"{self.base_url}/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        out: dict[str, float] = {}
        for line in resp.text.splitlines():
            if not line.startswith("kvtool:connector"):
                continue
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0].removesuffix("_total")
            if 'direction="load"' in series:
                name += ":load"
            elif 'direction="store"' in series:
                name += ":store"
            out[name] = out.get(name, 0.0) + float(value)
        return out or None

    def run_pass(self, requests: list[PassRequest], progress: Progress | None = None) -> PassResult:
        """Send every request (arrival rules as trace_pass.py); records in input order."""
        before = self.read_metrics()
        t0 = time.perf_counter()
        records = asyncio.run(self._run_all(requests, progress))
        wall_s = time.perf_counter() - t0
        after = self.read_metrics()

        def delta(name: str) -> int | None:
            if before is None or after is None or name not in after:
                return None
            return int(after[name] - before.get(name, 0.0))

        return PassResult(
            records=records, wall_s=wall_s, bytes_loaded=delta("kvtool:connector_transfer_bytes:load"),
            bytes_stored=delta("kvtool:connector_transfer_bytes:store"),
            external_tokens_loaded=delta("kvtool:connector_loaded_tokens"),
        )

    async def _run_all(self, requests: list[PassRequest], progress: Progress | None) -> list[RequestRecord]:
        done = [0]
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None)) as client:

            async def one(req: PassRequest) -> RequestRecord:
                rec = await self._send(client, req)
                done[0] += 1
                if progress is not None:
                    progress("", done[0] / len(requests))
                return rec

            tasks: list[asyncio.Task] = []
            t0 = time.perf_counter()
            for req in requests:
                if req.arrival_s is None:
                    if tasks:
                        await asyncio.wait([tasks[-1]])
                else:
                    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(one(req)))
            return list(await asyncio.gather(*tasks))

    def _body(self, req: PassRequest) -> dict:
        sp = req.sampling
        body: dict = {"model": self.model, "prompt": req.prompt_token_ids, "max_tokens": sp.max_tokens,
                      "temperature": sp.temperature, "stream": True, "stream_options": {"include_usage": True}}
        # vLLM's extras only when they differ from the neutral value, for servers without them.
        if sp.top_p != 1.0:
            body["top_p"] = sp.top_p
        if sp.top_k > 0:
            body["top_k"] = sp.top_k
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.ignore_eos:
            body["ignore_eos"] = True
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        if req.cache_salt:
            body["cache_salt"] = req.cache_salt
        if self.returns_token_ids:
            body["return_token_ids"] = True
        return body

    async def _send(self, client: httpx.AsyncClient, req: PassRequest) -> RequestRecord:
        ids: list[int] = []
        text: list[str] = []
        usage: dict = {}
        finish = "running"
        error = None
        ttft = None
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", f"{self.base_url}/v1/completions", json=self._body(req)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    error, finish = f"HTTP {resp.status_code}: {_error_message(body)}", "error"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: "):].strip()
                        if payload == "[DONE]":
                            break
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            error, finish = _error_message(payload), "error"
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            new_ids = choice.get("token_ids") or []
                            if ttft is None and (new_ids or choice.get("text")):
                                ttft = time.perf_counter() - t0
                            ids += new_ids
                            text.append(choice.get("text") or "")
                            if choice.get("finish_reason"):
                                finish = choice["finish_reason"]
        except httpx.HTTPError as e:
            error, finish = f"the request failed: {e}", "error"
        details = usage.get("prompt_tokens_details") or {}
        return RequestRecord(
            name=req.name, line=req.line, num_prompt_tokens=usage.get("prompt_tokens", len(req.prompt_token_ids)),
            output_token_ids=ids, finish_reason=finish, error=error,
            num_cached_tokens=details.get("cached_tokens") or 0, ttft_s=ttft,
            output_text=None if self.returns_token_ids else "".join(text),
            num_output_tokens=usage.get("completion_tokens"),
        )


def _error_message(body: str) -> str:
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    err = doc.get("error", doc)
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)
