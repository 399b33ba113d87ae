"""`kvtool serve` with a KV connector: hits in /metrics and cached_tokens, identical output, clean SIGTERM."""

import json
import signal
import threading

import openai
import pytest
import torch

from tests.support.server_process import ServerProcess

PROMPT_IDS = [(i * 37) % 240 + 5 for i in range(300)]


def complete(client, model):
    r = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r


def _serve_args(tiny_model_dir, ktc):
    return ["--model", str(tiny_model_dir), "--device", "cpu", "--kv-cache-memory", "64M",
            "--no-enable-prefix-caching", "--kv-transfer-config", ktc]


@pytest.mark.parametrize("arm", ["offloading", "lmcache"])
def test_repeated_prompt_hits_the_connector(arm, tiny_model_dir, tmp_path, request):
    if arm == "offloading":
        ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"root_dir": str(tmp_path / "tier")}}
    else:
        server = request.getfixturevalue("lmcache_server")
        ktc = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
               "kv_connector_extra_config": {"host": server.host, "port": server.port, "hash_algo": "vllm",
                                             "chunk_tokens": 64}}
    with ServerProcess(["--model", str(tiny_model_dir), "--device", "cpu", "--kv-cache-memory", "64M"]) as ref_server:
        ref = complete(openai.OpenAI(base_url=ref_server.base_url, api_key="x"), str(tiny_model_dir))
    with ServerProcess(_serve_args(tiny_model_dir, json.dumps(ktc))) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        first = complete(client, str(tiny_model_dir))
        second = complete(client, str(tiny_model_dir))
        m = srv.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected_hit = 288 if arm == "offloading" else 256  # whole blocks / chunks before the last token
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit
    assert m["kvtool:connector_loaded_tokens_total"] == expected_hit
    assert m["vllm:external_prefix_cache_hits_total"] == expected_hit
    assert m["kvtool:connector_stored_tokens_total"] >= expected_hit
    loaded_bytes = [m["vllm:kv_offload_load_bytes_total"]]
    assert loaded_bytes and loaded_bytes[0] > 0
    assert first.choices[0].text == second.choices[0].text == ref.choices[0].text


def test_sigterm_leaves_no_temporary_files(tiny_model_dir, tmp_path):
    root = tmp_path / "tier"
    ktc = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"root_dir": str(root)}})
    srv = ServerProcess(_serve_args(tiny_model_dir, ktc)).start()
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    done = threading.Event()

    def stream():
        try:
            for _ in client.completions.create(model=str(tiny_model_dir), prompt=PROMPT_IDS * 3, max_tokens=400,
                                               stream=True, extra_body={"ignore_eos": True}):
                pass
        except Exception:  # noqa: BLE001 - the server goes away mid-stream on purpose
            pass
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    # Wait until the prompt's blocks were stored, then stop the server mid-stream.
    for _ in range(600):
        if srv.metrics().get("kvtool:connector_stored_tokens_total", 0) > 0:
            break
        done.wait(0.1)
    status = srv.stop(signal.SIGTERM, timeout_s=30)
    t.join(30)
    assert status in (0, -signal.SIGTERM, 130)
    assert not [p for p in root.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert list(root.rglob("*.kvb"))


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_restarted_server_loads_the_prefix_from_disk(kv_cache_dtype, device, tmp_path):
    """Gemma 3 (local and global layers, a KV cache group each kind) served with a CPU + disk
    tier: after a restart the prompt's blocks of every group come from disk (hits in /metrics and
    cached_tokens) and the greedy text is the first server's; with the model's KV dtype and with
    an fp8 cache, on CPU and on CUDA."""
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / "tiny-gemma3"
    create_model_dir(model, preset="tiny-gemma3", seed=4)
    ktc = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"root_dir": str(tmp_path / "tier")}})
    args = [*_serve_args(model, ktc), "--kv-cache-dtype", kv_cache_dtype]
    args[args.index("--device") + 1] = device
    with ServerProcess(args) as srv:
        first = complete(openai.OpenAI(base_url=srv.base_url, api_key="x"), str(model))
    with ServerProcess(args) as srv:
        again = complete(openai.OpenAI(base_url=srv.base_url, api_key="x"), str(model))
        m = srv.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 288  # whole blocks before the last token
    assert m["kvtool:connector_loaded_tokens_total"] == 288
    assert m["kvtool:connector_loaded_from_disk_tokens_total"] >= 288  # a new process: its CPU tier was empty
    assert again.choices[0].text == first.choices[0].text


def test_gemma_served_with_kv_cache_groups_hits_its_prefix_cache(tmp_path):
    """Gemma 3 served without a connector runs KV cache groups: a repeated prompt is served from
    the prefix cache of every group (its local layers' window included), the text equals a server
    with one group (--disable-hybrid-kv-cache-manager), and /metrics counts the hit and an empty
    cache once the requests are done (the null block is not counted)."""
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / "tiny-gemma3"
    create_model_dir(model, preset="tiny-gemma3", seed=4)
    base = ["--model", str(model), "--device", "cpu", "--kv-cache-memory", "64M"]
    with ServerProcess([*base, "--disable-hybrid-kv-cache-manager"]) as srv:
        ref = complete(openai.OpenAI(base_url=srv.base_url, api_key="x"), str(model))
    with ServerProcess(base) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        first = complete(client, str(model))
        second = complete(client, str(model))
        m = srv.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 288  # whole blocks before the last token
    assert m["vllm:prefix_cache_hits_total"] == 288
    assert m["vllm:kv_cache_usage_perc"] == 0.0
    assert first.choices[0].text == second.choices[0].text == ref.choices[0].text
