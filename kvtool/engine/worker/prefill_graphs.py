"""CUDA graphs for a step that computes one prompt token alone: a full hit's last token.

A full hit loads a prompt's whole prefix and computes its last token through the prefill
kernels, so that the row has the bits it has inside a whole-prompt prefill. Run eagerly, that
one-token forward is about ten Triton launches per layer and costs the host more than the
device. Everything whose shapes are fixed for one row is replayed here from graphs captured at
start-up; per layer only the attention over the prefix stays eager, since its key count is the
prompt's:

    graph   embedding, cos/sin, first norm, layer 0's qkv GEMM
    per layer l:
      hook  before_layer(l): a connector's load of layer l lands first
      graph q/k norms and RoPE, k/v stored at the token's page slot
      eager attention over the prefix (gather + prefill kernel) into one fixed buffer
      hook  after_layer(l)
      graph o_proj, residual + norm, MLP, residual + norm, layer l+1's qkv GEMM (after the
            last layer: the final norm)

The graphs run the eager forward's kernels on the same one-row shapes, captured with the
row-invariant GEMMs (`row_invariant=True` in the capture's metadata) as every prefill step runs,
so the token's bits are the eager ones. They read one int32 buffer (token id, position, and the
token's page slot in each KV cache group's block) that `run` fills from the step's packed
inputs; their outputs live in their own memory pool until the next `run`.

Only the fused forward of a single-GPU model has these pieces (`supports`: what
`fast_paths.apply_fast_paths` chose says so).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtool.engine.kernels.attention import AttentionMetadata, attention_context
from kvtool.engine.kernels.attention.cuda import cuda_attention
from kvtool.engine.kv.pages import KVPages
from kvtool.engine.models.fast_paths import FastPaths
from kvtool.engine.models.fused_ops import (
    attention_output,
    attention_softcap,
    decoder_input,
    layer_output,
    qkv_projection,
    rotate_qkv,
)
from kvtool.engine.models.layers import CausalLM


def supports(model: CausalLM, fast_paths: FastPaths) -> bool:
    """Whether `model` runs the fused decoder forward, with every attention block fused, on one
    GPU (the pieces the graphs replay)."""
    return model.tp.size == 1 and fast_paths.residual_in_norm and fast_paths.fused_qkv


class OneTokenPrefillGraphs:
    def __init__(self, model: CausalLM, kv_pages: KVPages) -> None:
        self.decoder = model.model
        self.kv_pages = kv_pages
        device = kv_pages.device
        # Token id, position and each KV cache group's slot 16 bytes apart, as the packed step's
        # own segments start.
        num_groups = kv_pages.layout.num_groups
        self.inputs = torch.zeros(4 * (2 + num_groups), dtype=torch.int32, device=device)
        self.ids, self.positions = self.inputs[0:1], self.inputs[4:5]
        self.slots = [self.inputs[4 * g : 4 * g + 1] for g in range(2, 2 + num_groups)]
        self.layer_group = kv_pages.layout.layer_group
        first = self.decoder.layers[0].self_attn
        # In the activations' dtype, q's (fp8 pages hold another).
        dtype = self.decoder.embed_tokens.weight.dtype
        self.attn_out = torch.zeros((1, first.num_heads, first.head_dim), dtype=dtype, device=device)
        self.graphs: list[torch.cuda.CUDAGraph] = []  # the input graph, then (rope, rest) per layer
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # rope graph outputs per layer
        self.hidden: torch.Tensor | None = None  # the final norm's output [1, hidden]
        self.replays = 0

    def capture(self) -> None:
        """Capture every graph (start-up; the kernels are compiled by then)."""
        decoder = self.decoder
        layers = decoder.layers
        self.inputs.zero_()
        self.inputs[8::4] = -1  # the capture's runs store nothing in the pages
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.kv_pages.device)

        def graphed(fn: Callable[[], tuple]) -> tuple:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = fn()
            self.graphs.append(graph)
            return out

        def start() -> tuple:
            h, x, cos, sin = decoder_input(decoder, self.ids, self.positions)
            return h, cos, sin, qkv_projection(layers[0].self_attn, x)

        # Every projection as a prefill step runs it; no step's pages or slots (the graphs read
        # their own inputs).
        capture = AttentionMetadata(kv_pages=self.kv_pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                    row_invariant=True)
        with attention_context(capture):
            h, cos, sin, qkv = graphed(start)
            for i, layer in enumerate(layers):
                attn = layer.self_attn
                slots = self.slots[self.layer_group[attn.layer_idx]]
                self.qkv.append(graphed(lambda: rotate_qkv(attn, qkv, cos, sin, self.kv_pages, slots)))

                def rest() -> tuple:
                    h_next, x = layer_output(decoder, i, h, attention_output(attn, self.attn_out))
                    return h_next, x, qkv_projection(layers[i + 1].self_attn, x) if i + 1 < len(layers) else None

                h, self.hidden, qkv = graphed(rest)
        torch.cuda.synchronize(self.kv_pages.device)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of one prompt token (input_ids, positions [1], the step's metadata: its
        slot, its prefix's key slots, each KV cache group's, and the connector's hooks). Returns
        the final hidden state [1, hidden], graph memory: read it before the next run."""
        hooks = meta.hooks
        self.ids.copy_(input_ids)
        self.positions.copy_(positions)
        for slots, group_meta in zip(self.slots, meta.group_metas or [meta]):
            slots.copy_(group_meta.device_batch.slot_mapping)
        graphs = iter(self.graphs)
        next(graphs).replay()
        for layer, (q, k, v) in zip(self.decoder.layers, self.qkv):
            attn = layer.self_attn
            if hooks is not None:
                hooks.before_layer(attn.layer_idx)
            next(graphs).replay()
            cuda_attention(meta.for_layer(attn.layer_idx), attn.layer_idx, q, k, v, attn.scale, kv_stored=True,
                           out=self.attn_out, window=attn.sliding_window, softcap=attention_softcap(attn))
            if hooks is not None:
                hooks.after_layer(attn.layer_idx)
            next(graphs).replay()
        self.replays += 1
        return self.hidden
