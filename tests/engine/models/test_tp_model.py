"""Tensor-parallel shards compute what the whole model computes.

Two real processes join a gloo group on loopback; each builds its rank's shard with
`build_model(..., tp=TPRank(2, rank))` and runs a prefill and a few greedy decode steps of two
prompts through kvtool's own ModelRunner (hand-built SchedulerOutputs, KV pages of the rank's
KV heads). On the tiny preset (dummy weights, and its saved safetensors), on the embedded
default model SmolLM2-135M (real weights; 9 query / 3 KV heads, so rank 0 holds KV heads 0-1 and
rank 1 KV head 2) and on a small Llama with biases, an untied LM head and odd MLP and vocab
sizes (dummy weights, and saved across several safetensors files), and on the tiny-qwen2
preset (q/k/v biases, none on o_proj), on the tiny-mixtral and tiny-qwen3-moe presets (every
expert's gate/up rows and down columns sharded, the router replicated), on phi-3-tiny (q/k/v and
gate/up stored fused, split as they load, then sharded; 96-wide heads) and on the saved tiny-fp8
checkpoint (block-wise FP8, each rank dequantising its rows, KV rows that start inside a 128-row
scale block), and on tiny-gemma3 and tiny-gemma2 (Gemma's norms replicated, local and global layers, soft caps): the
greedy tokens equal one
process's, the gathered logits are within float32 rounding of one process's and bit-identical on
both ranks, and every parameter of a shard is exactly the rank's slice (rows or columns written
out below, not derived from the code under test) of the whole model's tensor. A broken weights
directory is refused by each rank with the line one process gives.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvtool.engine.core.messages import NewRequestData, ScheduledRequest, SchedulerOutput
from kvtool.engine.errors import ModelError
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.models import build_model, iter_dummy_tensors
from kvtool.engine.models.fast_paths import apply_fast_paths
from kvtool.engine.models.model_dir import open_model_dir
from kvtool.engine.models.shard_layout import TPRank
from kvtool.engine.params import SamplingParams
from kvtool.engine.worker.model_runner import ModelRunner
from kvtool.workloads.local_process import free_port

BLOCK_SIZE = 16
DECODE_STEPS = 4
TINY_PROMPTS = [[(5 * j + 3) % 250 + 1 for j in range(21)], [(11 * j) % 240 + 2 for j in range(40)]]
PROMPTS = {"tiny": TINY_PROMPTS, "uneven": TINY_PROMPTS, "qwen2": TINY_PROMPTS, "mixtral": TINY_PROMPTS,
           "qwen3moe": TINY_PROMPTS, "phi3": TINY_PROMPTS, "fp8": TINY_PROMPTS, "gemma3": TINY_PROMPTS, "gemma2": TINY_PROMPTS,
           "default": [[504, 3458, 314, 260, 3575, 282, 4649, 47], [19556, 28, 1834, 359, 346, 44, 2492, 30, 1076]]}
# Per rank: (first, count) of its query heads, KV heads, MLP rows and vocabulary rows.
SPLITS = {
    "tiny": [((0, 2), (0, 1), (0, 384), (0, 256)), ((2, 2), (1, 1), (384, 384), (256, 256))],
    "qwen2": [((0, 2), (0, 1), (0, 384), (0, 256)), ((2, 2), (1, 1), (384, 384), (256, 256))],
    "default": [((0, 6), (0, 2), (0, 768), (0, 24576)), ((6, 3), (2, 1), (768, 768), (24576, 24576))],
    "uneven": [((0, 4), (0, 2), (0, 126), (0, 255)), ((4, 2), (2, 1), (126, 125), (255, 254))],
    # MoE: the MLP rows are each expert's (Qwen3-MoE's dense last layer: EXPERT_ROWS's second entry).
    "mixtral": [((0, 2), (0, 1), (0, 192), (0, 256)), ((2, 2), (1, 1), (192, 192), (256, 256))],
    "qwen3moe": [((0, 2), (0, 1), (0, 96), (0, 256)), ((2, 2), (1, 1), (96, 96), (256, 256))],
    "phi3": [((0, 1), (0, 1), (0, 256), (0, 256)), ((1, 1), (1, 1), (256, 256), (256, 256))],
    "fp8": [((0, 2), (0, 1), (0, 384), (0, 256)), ((2, 2), (1, 1), (384, 384), (256, 256))],
    "gemma3": [((0, 2), (0, 1), (0, 384), (0, 256)), ((2, 2), (1, 1), (384, 384), (256, 256))],
    "gemma2": [((0, 2), (0, 1), (0, 384), (0, 256)), ((2, 2), (1, 1), (384, 384), (256, 256))],
}
# Per rank: (first, count) of a Qwen3-MoE dense layer's MLP rows (intermediate_size 512).
DENSE_ROWS = {"qwen3moe": [(0, 256), (256, 256)]}
# A Llama whose every split is uneven, with biases on q/k/v/o and an untied LM head.
UNEVEN = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=192, intermediate_size=251,
              num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=32, vocab_size=509,
              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
              attention_bias=True, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
LOAD_FORMAT = {"tiny": "dummy", "default": "auto", "uneven": "dummy", "qwen2": "dummy", "mixtral": "dummy",
               "qwen3moe": "dummy", "phi3": "auto", "fp8": "auto", "gemma3": "auto", "gemma2": "auto"}
MOE_PRESETS = {"mixtral": "tiny-mixtral", "qwen3moe": "tiny-qwen3-moe"}
# Cases read from a saved preset directory (random weights written by `create_model_dir`).
SAVED_PRESETS = {"phi3": "phi-3-tiny", "fp8": "tiny-fp8", "gemma3": "tiny-gemma3", "gemma2": "tiny-gemma2"}
JOIN_TIMEOUT_S = 600


def _expected_slice(name: str, full: torch.Tensor, case: str, rank: int, head_dim: int) -> torch.Tensor:
    """The part of the whole model's tensor `name` that rank `rank` of 2 must hold."""
    (q0, nq), (k0, nk), (m0, nm), (v0, nv) = SPLITS[case][rank]
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return full[q0 * head_dim : (q0 + nq) * head_dim]
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        return full[k0 * head_dim : (k0 + nk) * head_dim]
    if name.endswith("o_proj.weight"):
        return full[:, q0 * head_dim : (q0 + nq) * head_dim]
    if case in DENSE_ROWS and ".experts." not in name:
        m0, nm = DENSE_ROWS[case][rank]
    if name.endswith(("gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")):
        return full[m0 : m0 + nm]
    if name.endswith(("down_proj.weight", "w2.weight")):
        return full[:, m0 : m0 + nm]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return full[v0 : v0 + nv]
    return full  # norms and row-parallel biases are replicated


def _drive(model, case: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy prefill + DECODE_STEPS decode steps of the case's prompts through a ModelRunner.
    Returns each prompt's tokens and the logits of every step."""
    cfg = model.config
    num_kv_heads = model.model.layers[0].self_attn.num_kv_heads
    geometry = KVGeometry(num_layers=cfg.num_layers, num_kv_heads=num_kv_heads, head_dim=cfg.head_dim,
                          block_size=BLOCK_SIZE, dtype="float32")
    runner = ModelRunner(model, KVPages(geometry, 16, torch.device("cpu")), torch.device("cpu"),
                         apply_fast_paths(model, "cpu", torch.float32))
    logits: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden):
        out = compute_logits(hidden)
        logits.append(out.clone())
        return out

    model.compute_logits = recording
    prompts = PROMPTS[case]
    greedy = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    blocks = [list(range(i * 4, i * 4 + 4)) for i in range(len(prompts))]  # 64 positions each
    so = SchedulerOutput(
        new_requests=[NewRequestData(request_id=r, prompt_token_ids=p, output_token_ids=[], sampling=greedy, seed=0)
                      for r, p in zip(ids, prompts)],
        scheduled=[ScheduledRequest(request_id=r, token_ids=p, start=0, new_block_ids=b, sample=True)
                   for r, p, b in zip(ids, prompts, blocks)],
    )
    tokens = [[] for _ in prompts]
    for _ in range(DECODE_STEPS + 1):
        sampled = runner.execute(so).sampled
        for i, r in enumerate(ids):
            tokens[i].append(sampled[r])
        so = SchedulerOutput(scheduled=[
            ScheduledRequest(request_id=r, token_ids=[t[-1]], start=len(p) + len(t) - 1, new_block_ids=[], sample=True)
            for r, p, t in zip(ids, prompts, tokens)
        ])
    return tokens, logits


def _full_tensors(case: str, model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the whole model, as one process has it."""
    if case in SAVED_PRESETS:  # as one process loads them: split where stored fused, dequantised
        whole = build_model(model_dir, "cpu", torch.float32, "auto")
        return {name: p.detach() for name, p in whole.named_parameters()}
    if case != "default":
        return dict(iter_dummy_tensors(model_dir.config, "cpu", 0))
    from safetensors.torch import load_file

    return load_file(str(model_dir.path / "model.safetensors"))


def _load_error(path: str, tp: TPRank) -> str:
    """The one-line ModelError building from a broken directory gives."""
    try:
        build_model(open_model_dir(path), "cpu", torch.float32, "auto", tp=tp)
    except ModelError as e:
        return str(e)
    return "loaded"


def _rank_main(rank: int, case: str, path: str, broken: list[str], port: int, out: str) -> None:
    """One rank: join the group, build the shard(s), check them, run the steps, save the results."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model_dir = open_model_dir(path)
        tp = TPRank(2, rank)
        model = build_model(model_dir, "cpu", torch.float32, LOAD_FORMAT[case], seed=0, tp=tp)
        full = _full_tensors(case, model_dir)
        wrong = [name for name, p in model.named_parameters()
                 if not torch.equal(p, _expected_slice(name, full[name], case, rank, model_dir.config.head_dim))]
        del full
        if LOAD_FORMAT[case] == "dummy":  # the saved weights, read slice by slice, give the same shard
            saved = build_model(model_dir, "cpu", torch.float32, "auto", tp=tp)
            wrong += [f"saved {n}" for (n, p), q in zip(model.named_parameters(), saved.parameters())
                      if not torch.equal(p, q)]
        attn = model.model.layers[0].self_attn
        tokens, logits = _drive(model, case)
        torch.save({"tokens": tokens, "logits": logits, "wrong": wrong, "heads": (attn.num_heads, attn.num_kv_heads),
                    "errors": [_load_error(b, tp) for b in broken]}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(case: str, path: str, broken: list[str], out: Path) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(case, path, broken, free_port(), str(out)), nprocs=2,
                             join=False, start_method="spawn")
    try:
        for _ in range(JOIN_TIMEOUT_S):
            if ctx.join(timeout=1):
                break
        else:
            pytest.fail(f"the 2 ranks did not finish within {JOIN_TIMEOUT_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _broken_copies(src: Path, root: Path) -> list[str]:
    """Copies of a model directory with a shape that config.json contradicts, a missing tensor
    and a truncated file: a rank refuses each with the same line one process does."""
    from safetensors.torch import load_file, save_file

    made = []
    for fault in ("shape", "missing", "truncated"):
        d = root / fault
        shutil.copytree(src, d)
        weights = d / "model.safetensors"
        if fault == "shape":
            cfg = json.loads((d / "config.json").read_text())
            cfg["intermediate_size"] += 2
            (d / "config.json").write_text(json.dumps(cfg))
        elif fault == "missing":
            tensors = load_file(weights)
            del tensors["model.layers.1.mlp.down_proj.weight"]
            save_file(tensors, weights, metadata={"format": "pt"})
        else:
            data = weights.read_bytes()
            weights.write_bytes(data[: len(data) - 1000])
        made.append(str(d))
    return made


@pytest.fixture(scope="module", params=sorted(LOAD_FORMAT))
def case(request, tmp_path_factory):
    """(case name, model directory, broken copies) of the tiny preset, the embedded default
    model or the uneven Llama (saved in several safetensors files)."""
    if request.param == "default":
        from kvtool.engine.presets.default_model import ensure_default_model

        return request.param, ensure_default_model(), []
    root = tmp_path_factory.mktemp("models")
    if request.param == "uneven":
        from kvtool.engine.presets.catalog import write_random_model_dir

        write_random_model_dir(root / "uneven", UNEVEN, seed=0, max_shard_bytes=200_000)
        return request.param, root / "uneven", []
    from kvtool.engine.presets.catalog import create_model_dir

    if request.param in MOE_PRESETS:
        create_model_dir(root / request.param, preset=MOE_PRESETS[request.param], seed=0)
        return request.param, root / request.param, []
    if request.param in SAVED_PRESETS:
        create_model_dir(root / request.param, preset=SAVED_PRESETS[request.param], seed=0)
        return request.param, root / request.param, []
    if request.param == "qwen2":  # q/k/v biases sharded like their weights, none on o_proj
        create_model_dir(root / "qwen2", preset="tiny-qwen2", seed=0)
        return request.param, root / "qwen2", []
    create_model_dir(root / "tiny", preset="tiny", seed=0)
    return request.param, root / "tiny", _broken_copies(root / "tiny", root)


def test_two_ranks_compute_what_one_process_does(case, tmp_path):
    name, path, broken = case
    model_dir = open_model_dir(path)
    whole = build_model(model_dir, "cpu", torch.float32, LOAD_FORMAT[name], seed=0)
    ref_tokens, ref_logits = _drive(whole, name)
    ref_errors = [_load_error(b, TPRank()) for b in broken]
    ranks = _run_ranks(name, str(path), broken, tmp_path)

    for r, result in enumerate(ranks):
        assert result["wrong"] == [], f"rank {r} holds wrong weights"
        (_, nq), (_, nk), _, _ = SPLITS[name][r]
        assert result["heads"] == (nq, nk)
        assert result["errors"] == ref_errors and "loaded" not in ref_errors
        assert result["tokens"] == ref_tokens
        assert len(result["logits"]) == len(ref_logits)
        for got, want in zip(result["logits"], ref_logits):
            assert got.shape == want.shape == (len(PROMPTS[name]), model_dir.config.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.equal(a, b), "the ranks' gathered logits differ"
