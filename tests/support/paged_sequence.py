"""One sequence fed to a built model the way the runner feeds it, over real KV pages and
attention metadata: a prefill, then greedy decode steps. The architecture tests against
transformers (CPU and CUDA) run their models through it."""

from __future__ import annotations

import math

import torch

from kvtool.engine.kernels.attention import AttentionMetadata, SeqSpan, attention_context
from kvtool.engine.kv.pages import DTYPE_NAMES, KVGeometry, KVPages
from kvtool.engine.models.model_dir import ModelConfig


class PagedSequence:
    """One sequence over real KV pages (the model's device and dtype), fed the way the runner feeds it."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, max_tokens: int, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        weight = next(model.parameters())
        self.device = weight.device
        num_blocks = math.ceil(max_tokens / block_size)
        geometry = KVGeometry(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                              head_dim=config.head_dim, block_size=block_size, dtype=DTYPE_NAMES[weight.dtype])
        # One spare block, and the sequence's blocks in reverse order: the page table must be followed.
        self.pages = KVPages(geometry, num_blocks + 1, self.device)
        self.block_ids = torch.arange(num_blocks, 0, -1, device=self.device)
        self.num_tokens = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Compute the new tokens; returns their float32 logits [len(token_ids), vocab] on the CPU."""
        start, end = self.num_tokens, self.num_tokens + len(token_ids)
        positions = torch.arange(start, end, device=self.device)
        meta = AttentionMetadata(
            kv_pages=self.pages,
            seqs=[SeqSpan(q_start=0, q_len=len(token_ids), ctx_len=end,
                          block_ids=self.block_ids[: math.ceil(end / self.block_size)])],
            slot_block_ids=self.block_ids[positions // self.block_size],
            slot_offsets=positions % self.block_size,
        )
        with torch.inference_mode(), attention_context(meta):
            hidden = self.model(torch.tensor(token_ids, device=self.device), positions)
            logits = self.model.compute_logits(hidden)
        self.num_tokens = end
        return logits.cpu()


def greedy_run(model, config: ModelConfig, prompt: list[int], num_steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill, then greedy decode steps. Returns (logits at every fed position [P + S, V], generated ids [S])."""
    seq = PagedSequence(model, config, len(prompt) + num_steps)
    logits = [seq.step(prompt)]
    generated: list[int] = []
    for _ in range(num_steps):
        generated.append(int(logits[-1][-1].argmax()))
        logits.append(seq.step([generated[-1]]))
    return torch.cat(logits), generated
