"""An FP8 checkpoint on the GPU: its projections stay FP8 and compute on the FP8 tensor cores.

- the tiny-fp8 checkpoint built in bf16 keeps every projection's weight and scale as stored
  (`Fp8Linear`), and every projection route is "fp8";
- its logits against references on the same prompt and generated tokens: transformers' own FP8
  model on the GPU where this transformers runs the checkpoint (fine-grained FP8: the same
  per-row, per-128 activation groups), within FP8_SAME_SCHEME_ATOL; always the dense checkpoint
  the FP8 one stands for (dequantised, bf16 in transformers), within FP8_ATOL, the error that
  quantising the activations to FP8 adds; greedy choices equal wherever the reference's top two
  logits are more than twice the tolerance apart;
- batch invariance with CUDA graphs, and a prefix hit's tokens equal to the cold run's.
Skipped without CUDA or without FP8 tensor cores.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.batch_invariance import tokens

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device with FP8 tensor cores"),
]

DEV = torch.device("cuda")
# Logits of the 4-layer tiny model (spread about 1): FP8 activations against dense ones move
# them by up to about 0.5 (measured on CPU in float32, the activations quantised as the kernel does).
FP8_ATOL = 0.75
# Against transformers' FP8 model: the same quantisation, bf16 rounding elsewhere.
FP8_SAME_SCHEME_ATOL = 0.15
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    from kvtool.engine.presets.catalog import create_model_dir

    root = tmp_path_factory.mktemp("fp8")
    create_model_dir(root / "tiny-fp8", preset="tiny-fp8", seed=2)
    return root / "tiny-fp8"


def _forced_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids], device=DEV)).logits[0].float().cpu()


def _transformers_fp8(path):
    """transformers' FP8 model of the checkpoint on the GPU, or None where this transformers cannot run it."""
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    except (ImportError, ValueError, RuntimeError):
        return None
    if not any(p.dtype == torch.float8_e4m3fn for p in hf.parameters()):
        return None  # loaded dequantised: not the FP8 reference
    try:
        with torch.inference_mode():
            hf(torch.tensor([[1]], device=DEV))
    except ImportError:
        return None  # its FP8 products need a kernels package this environment lacks
    return hf.eval()


def _check(logits: torch.Tensor, ref: torch.Tensor, prompt_len: int, generated: list[int], atol: float) -> None:
    diff = (logits - ref).abs().amax(-1)
    assert diff.max() <= atol, f"logits {diff.max():.3f} from the reference (at most {atol})"
    top2 = ref[prompt_len - 1 : -1].topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    choice = ref[prompt_len - 1 : -1].argmax(-1)
    assert all(int(h) == g for h, g, c in zip(choice, generated, clear) if c)


def test_fp8_projections_compute_in_fp8_against_transformers_and_the_dense_checkpoint(fp8_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from kvtool.engine.models import build_model
    from kvtool.engine.models.fast_paths import apply_fast_paths
    from kvtool.engine.models.fp8_linear import Fp8Linear
    from kvtool.engine.models.model_dir import open_model_dir
    from tests.support.fp8_checkpoint import dense_copy
    from tests.support.paged_sequence import greedy_run

    md = open_model_dir(fp8_dir)
    ours = build_model(md, DEV, torch.bfloat16, "auto")
    stored = load_file(str(fp8_dir / "model.safetensors"))
    projections = {n: m for n, m in ours.named_modules() if n.rpartition(".")[2] in PROJECTIONS}
    assert projections and all(isinstance(m, Fp8Linear) for m in projections.values())
    for name, module in projections.items():
        assert torch.equal(module.weight.cpu().view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(module.weight_scale.cpu(), stored[f"{name}.weight_scale_inv"].float())
    paths = apply_fast_paths(ours, DEV, torch.bfloat16)
    routes = paths.gemm
    assert (routes.qkv, routes.o_proj, routes.gate_up, routes.down_proj) == ("fp8",) * 4
    prompt = tokens(64, 1)
    logits, generated = greedy_run(ours, md.config, prompt, 32)
    logits = logits.float().cpu()
    del ours

    hf = _transformers_fp8(fp8_dir)
    if hf is not None:
        _check(logits, _forced_logits(hf, prompt + generated), len(prompt), generated, FP8_SAME_SCHEME_ATOL)
        del hf
    dense_copy(fp8_dir, tmp_path / "dense")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.bfloat16, attn_implementation="sdpa")
    _check(logits, _forced_logits(hf.to(DEV).eval(), prompt + generated), len(prompt), generated, FP8_ATOL)


def test_fp8_model_is_batch_invariant_with_graphs_and_hits_give_its_bits(fp8_dir):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams
    from tests.support.batch_invariance import SP, TARGETS, alone_equals_batched

    engine = LLMEngine(EngineParams(model=str(fp8_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=400,
                                    max_model_len=2000, batch_invariant=True, enable_prefix_caching=True))
    try:
        assert engine.executor.worker.fast_paths.gemm.qkv == "fp8"
        alone = [(r.output_token_ids, r.logprobs) for r in engine.generate(TARGETS, SP)]
        again = engine.generate(TARGETS, SP)  # the prompts' blocks now come from the prefix cache
        assert [(r.output_token_ids, r.logprobs) for r in again] == alone
        assert all(r.stats.num_cached_tokens > 0 for r in again)
        alone_equals_batched(engine)
    finally:
        engine.close()
