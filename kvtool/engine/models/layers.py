"""Pieces shared by the decoder-only models: RMSNorm, rotary embedding (frequencies from `rope`), gated MLP,
and the decoder skeleton that each model file fills with its own attention.

Every operation follows transformers' reference order (float32 norm statistics, cos/sin in float32
then cast, `x * cos + rotate_half(x) * sin`) so float32 logits match it to rounding.

On CPU a forward and the logits run on a multiple of ROW_MULTIPLE rows (zero-id padding rows,
dropped from the result): BLAS computes few rows (1 to 3, with threads 5 to 7 or 9 to 11 on AVX2;
1 to 15 on AVX-512 and AMX machines) with other kernels than the same rows inside a larger batch,
so without it a request's bits would depend on how many requests it is batched with. A step of
at most ROW_MULTIPLE rows goes to a multiple of the model's `few_rows_multiple` instead, which
`cpu_gemm` lowers to 4 or 8 where the machine's products give such rows the bits of larger batches.

Which forward runs: each module below computes with the plain ops written in it unless its
`fast_forward` field (RMSNorm, GatedMLP, DecoderModel; LlamaAttention in llama.py),
`fast_forward_rows` (DecoderLayer) or `logits_product` (CausalLM) is set. Those fields are set
once, by `fast_paths.apply_fast_paths` alone, before the first step; its docstring says which
fused forward (`cpu_fused` on CPU, `fused_ops` on CUDA) each one gets, and the `FastPaths` it
returns says what it chose for a model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.engine.kernels.attention import ROW_MULTIPLE
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.parallel import MOE_NAMES, RowParallelLinear, VocabParallelEmbedding, gather_vocab
from kvtool.engine.models.rope import rope_frequencies
from kvtool.engine.models.shard_layout import TPRank, split_range


def pad_rows_on_cpu(x: torch.Tensor, few: int = ROW_MULTIPLE) -> torch.Tensor:
    """x with zero rows appended along dim 0, on CPU (x elsewhere): up to a multiple of `few`
    while it has at most ROW_MULTIPLE rows, else of ROW_MULTIPLE (`few` divides ROW_MULTIPLE)."""
    n = x.shape[0]
    extra = -n % (few if n <= ROW_MULTIPLE else ROW_MULTIPLE)
    if x.device.type != "cpu" or not extra:
        return x
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


class Embedding(nn.Module):
    """Token embedding without nn.Embedding's random init: weights always come from a file or a seed,
    and normal_ on the meta device would pull in torch's compiler stack (seconds of import)."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, dim]."""
        return F.embedding(ids, self.weight)


def make_embedding(config: ModelConfig, tp: TPRank) -> nn.Module:
    """The token embedding of a decoder: the whole matrix, or a tensor-parallel rank's rows."""
    if tp.size == 1:
        return Embedding(config.vocab_size, config.hidden_size)
    return VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # fast_forward(self, x): a fused norm set by `apply_fast_paths`; None runs the one below.
        self.fast_forward: Callable[[RMSNorm, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dim in float32, then scale. Returns x's shape and dtype."""
        if self.fast_forward is not None:
            return self.fast_forward(self, x)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of one forward; computed per step from a [D/2] buffer and
    the attention factor (`rope.rope_frequencies`, for sequences of up to `seq_len` tokens)."""

    def __init__(self, config: ModelConfig, seq_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.seq_len = seq_len
        inv_freq, self.attention_factor = rope_frequencies(config, seq_len)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_inv_freq(self, device: torch.device, seq_len: int | None = None) -> None:
        """Recompute the float32 buffer on `device` (a model built on the meta device has none),
        for sequences of up to `seq_len` tokens (None: as before)."""
        if seq_len is not None:
            self.seq_len = seq_len
        inv_freq, self.attention_factor = rope_frequencies(self.config, self.seq_len)
        self.inv_freq = inv_freq.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions [T]. Returns ([T, D], [T, D]) in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # yarn, longrope: scaled in float32, before the cast
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (the half-split convention of HF checkpoints). Returns [T, H, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def concat_linear_params(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """The linears' weights (or biases) concatenated along the output dim, for one fused GEMM;
    each linear's parameter becomes a view of its slice, so no memory is duplicated."""
    parts = [getattr(m, attr) for m in linears]
    if parts[0] is None:
        return None
    whole = torch.cat([p.data for p in parts], dim=0)
    at = 0
    for m, p in zip(linears, parts):
        setattr(m, attr, nn.Parameter(whole[at : at + p.shape[0]], requires_grad=False))
        at += p.shape[0]
    return whole


class GatedMLP(nn.Module):
    """SwiGLU MLP; at tp.size > 1 the rank's rows of gate/up (column-parallel) and the same
    columns of down (row-parallel, one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPRank = TPRank()) -> None:
        super().__init__()
        rows = split_range(intermediate_size, tp.size, tp.rank)[1]
        self.gate_proj = nn.Linear(hidden_size, rows, bias=False)
        self.up_proj = nn.Linear(hidden_size, rows, bias=False)
        down_cls = nn.Linear if tp.size == 1 else RowParallelLinear
        self.down_proj = down_cls(rows, hidden_size, bias=False)
        # fast_forward(self, x): gate and up as one product (set by `apply_fast_paths`, with that
        # product's weight); None runs the one below.
        self.fast_forward: Callable[[GatedMLP, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU. [T, hidden] -> [T, hidden]."""
        if self.fast_forward is not None:
            return self.fast_forward(self, x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention and MLP blocks. The MLP is a GatedMLP, or in an MoE model's sparse layers the
    model's `moe_cls` block (`moe.SparseMoeBlock`), held under the checkpoint's name for it
    (`mlp`; Mixtral's `block_sparse_moe`, `parallel.MOE_NAMES`) and read as `mlp` either way."""

    def __init__(self, config: ModelConfig, attention: nn.Module, tp: TPRank = TPRank(),
                 moe_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if moe_cls is not None and attention.layer_idx in config.moe.sparse_layers:
            self.mlp_name = MOE_NAMES[config.architecture][0]
            self.add_module(self.mlp_name, moe_cls(config, tp))
        else:
            self.mlp_name = "mlp"
            self.add_module("mlp", GatedMLP(config.hidden_size, config.intermediate_size, tp))
        # fast_forward_rows(self, h, cos, sin, rows, few): `forward_rows` with attention and o_proj
        # for `rows` only too (set by `apply_fast_paths` on CPU); None runs the one below.
        self.fast_forward_rows: Callable[..., torch.Tensor] | None = None

    @property
    def mlp(self) -> nn.Module:
        if self.mlp_name not in self._modules:
            raise AttributeError("mlp")  # (add_module asks whether it exists before adding it)
        return self._modules[self.mlp_name]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-norm attention and MLP blocks with residuals. [T, hidden] -> [T, hidden]."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_rows(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                     few: int = ROW_MULTIPLE) -> torch.Tensor:
        """`forward` with only `rows` of the result wanted: attention runs on every row (it stores
        their K/V), the residual and the MLP on `rows` only (padded on CPU, `pad_rows_on_cpu`).
        [T, hidden] -> [len(rows) padded on CPU, hidden]; rows past len(rows) are padding."""
        if self.fast_forward_rows is not None:
            return self.fast_forward_rows(self, h, cos, sin, rows, few)
        a = self.self_attn(self.input_layernorm(h), cos, sin)
        h = pad_rows_on_cpu(h.index_select(0, rows) + a.index_select(0, rows), few)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, layers, final norm: the `model.` prefix of HF weight names."""

    def __init__(self, config: ModelConfig, attention_cls: type[nn.Module], tp: TPRank = TPRank(),
                 moe_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = make_embedding(config, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention_cls(config, i, tp), tp, moe_cls) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # On CPU, a step of at most ROW_MULTIPLE rows is padded to a multiple of this
        # (`apply_fast_paths` lowers it where the machine's products give those few rows the bits
        # of larger batches).
        self.few_rows_multiple = ROW_MULTIPLE
        # fast_forward(self, input_ids, positions, rows): the decoder loop with each residual add
        # fused into the next norm (set by `apply_fast_paths` on CUDA); None runs the one below.
        self.fast_forward: Callable[..., torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden], or with `rows`
        ([S] long) those rows only, [S, hidden]: the last layer's MLP and the final norm then run
        on S rows instead of T (a prefill samples one row of its prompt)."""
        if self.fast_forward is not None:
            return self.fast_forward(self, input_ids, positions, rows)
        n = input_ids.shape[0] if rows is None else rows.shape[0]
        few = self.few_rows_multiple
        input_ids, positions = pad_rows_on_cpu(input_ids, few), pad_rows_on_cpu(positions, few)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        layers = self.layers if rows is None else self.layers[:-1]
        for layer in layers:
            h = layer(h, cos, sin)
        if rows is not None:
            h = self.layers[-1].forward_rows(h, cos, sin, rows, few)
        return self.norm(h)[:n]


class CausalLM(nn.Module):
    """A decoder-only language model over the paged KV cache. Subclasses name their attention class.

    Interface the runner relies on: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`
    (packed tokens of every scheduled sequence, attention metadata from the step's context; on
    CPU with `rows`, the sampled rows' hidden states only) and
    `compute_logits(hidden [N, hidden]) -> float32 [N, vocab]`.

    With `tp` of size > 1 it is rank tp.rank's Megatron shard (see `parallel`): every rank
    runs the same steps, and both methods return the full, identical result on every rank.
    """

    attention_cls: type[nn.Module]
    # The MoE block of the config's sparse layers (Mixtral, Qwen3-MoE: `moe.SparseMoeBlock`).
    moe_cls: type[nn.Module] | None = None
    # Checkpoint module name -> this model's modules whose weights it stores, concatenated by rows
    # (Phi-3's qkv_proj and gate_up_proj); `models.build_model` splits them as it loads.
    packed_modules: dict[str, tuple[str, ...]] = {}
    # The decoder under `model.` (Gemma 3 has its own: other norms, two RoPEs, a scaled embedding).
    decoder_cls: type[nn.Module] = DecoderModel
    # Whether `fast_paths.apply_fast_paths` may set the CPU fused forwards (`cpu_fused`), written
    # for the modules above (Llama's norms, SiLU MLPs); a model of other modules (Gemma's) runs its
    # own forwards on CPU.
    fused_forwards = True
    # Whether `fused_ops` has fused CUDA forwards for the model's modules (the ones above, and
    # Gemma's): the engine refuses a model without them on CUDA, where neither CUDA graphs nor
    # batch invariance would hold.
    cuda_fused_forwards = True

    def __init__(self, config: ModelConfig, tp: TPRank = TPRank()) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = self.decoder_cls(config, self.attention_cls, tp, self.moe_cls)
        # Tied models read the embedding matrix as the output projection; no lm_head parameter exists.
        # Untied ones hold the same vocab rows of lm_head as of the embedding.
        vocab_rows = split_range(config.vocab_size, tp.size, tp.rank)[1]
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, vocab_rows, bias=False)
        # logits_product(hidden, row_invariant): the LM head's product (set by `apply_fast_paths`:
        # oneDNN over a reordered copy of the weight on CPU, `row_invariant_gemm` on CUDA); None
        # is F.linear over the weight itself.
        self.logits_product: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T], [T] -> [T, hidden]; with `rows` [S], only those rows: [S, hidden] (DecoderModel)."""
        return self.model(input_ids, positions, rows)

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True, row_invariant: bool = False) -> torch.Tensor:
        """[N, hidden] -> [N, vocab], float32 (or, with as_float=False, the weights' dtype: a
        decode graph takes its argmax from those and converts only when a sampler needs it).
        `row_invariant`: the step asks for rows independent of N (see `row_invariant_gemm`)."""
        x = pad_rows_on_cpu(hidden, self.model.few_rows_multiple)
        if self.logits_product is not None:
            logits = self.logits_product(x, row_invariant)[: hidden.shape[0]]
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(x, weight)[: hidden.shape[0]]
        if self.tp.size > 1:
            logits = gather_vocab(logits, self.config.vocab_size, self.tp)
        return logits.float() if as_float else logits
