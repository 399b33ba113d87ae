"""Runs one scheduled step: connector loads, the forward over the packed batch, sampling, stores.

Two ways to run the forward, picked once from data (`attention.select_backend`):

* reference (CPU, or CUDA without bf16/fp16 + Triton): per-sequence metadata, eager forward;
* cuda: the step's index tensors are packed into one int32 host array and copied in with one
  host-to-device copy; decode sequences (one new token each) come first. A step made only of
  decode sequences replays a captured CUDA graph when the connector has no per-layer work; a
  step of one prompt token alone (a full hit) replays graphs around its eager attention
  (`prefill_graphs`), hooks or not; anything else runs eagerly through the same kernels.

Sampling (`sampler.sample_on_device`) runs on the logits' device and leaves the token ids
there; a seeded draw is reproducible whatever the batch and the device.

The runner owns its batch state: per request, a block table, the sampling params, its seed and
the tokens it has seen, built from `NewRequestData` and grown from each `ScheduledRequest`.
It changes that state only from the scheduler's messages, never from the scheduler's objects,
so a pickled copy of every step's message drives it identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import msgspec
import numpy as np
import torch
from torch import nn

from kvtool.engine.kernels.attention import (
    AttentionMetadata,
    SeqSpan,
    attention_context,
    select_backend,
)
from kvtool.engine.connectors.base import WorkerHalf
from kvtool.engine.core.block_pool import NULL_BLOCK
from kvtool.engine.kv.pages import KVPages
from kvtool.engine.core.messages import (
    PLACEHOLDER_TOKEN,
    KVConnectorOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvtool.engine.models.fast_paths import FastPaths
from kvtool.engine.params import SamplingParams
from kvtool.engine.worker.cuda_step import GroupInputs, PackedStep, below_window, decode_rows, pack_step
from kvtool.engine.worker.pinned_staging import PinnedStaging
from kvtool.engine.worker.sampler import SampleRow, sample_on_device

__all__ = ["MAX_GRAPH_BATCH", "ModelRunner", "PackedStep", "PendingOutput", "decode_rows", "pack_step"]

MAX_GRAPH_BATCH = 512


class _ConnectorLayerHooks:
    """Routes the attention layers' per-layer calls to the connector's worker half."""

    def __init__(self, worker: WorkerHalf) -> None:
        self.worker = worker

    def before_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_layer(self, layer: int) -> None:
        self.worker.save_kv_layer(layer)


class _BlockTable:
    """A request's block ids of one KV cache group, as a growing int32 array."""

    __slots__ = ("table", "num_blocks")

    def __init__(self) -> None:
        self.table = np.zeros(16, dtype=np.int32)
        self.num_blocks = 0

    def add(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        n = self.num_blocks + len(block_ids)
        if n > len(self.table):
            grown = np.zeros(max(n, 2 * len(self.table)), dtype=np.int32)
            grown[: self.num_blocks] = self.table[: self.num_blocks]
            self.table = grown
        self.table[self.num_blocks : n] = block_ids
        self.num_blocks = n

    @property
    def view(self) -> np.ndarray:
        return self.table[: self.num_blocks]


@dataclass(slots=True)
class _RequestState:
    """What the runner keeps of one request between steps (its own copy, built from messages)."""

    sampling: SamplingParams
    seed: int
    num_prompt_tokens: int
    # The tokens it has seen (prompt, then outputs), for the samplers that read history.
    token_ids: list[int]
    eos_token_ids: frozenset[int]
    # One block table per KV cache group (`kv.groups`), in the order of the layout's groups.
    tables: list[_BlockTable] = field(default_factory=list)

    def add_blocks(self, block_ids: list[int], group_block_ids: list[list[int]]) -> None:
        """Append a step's new blocks: group 0's, then those of groups 1.. (multi-group layouts)."""
        self.tables[0].add(block_ids)
        for t, ids in zip(self.tables[1:], group_block_ids):
            t.add(ids)

    def see(self, start: int, token_ids: list[int]) -> None:
        """Record a step's tokens (known ones only: a placeholder's sample stays on the device)."""
        end = start + len(token_ids)
        if end > len(self.token_ids) and token_ids[-1] != PLACEHOLDER_TOKEN:
            self.token_ids.extend(token_ids[len(self.token_ids) - start :])


@dataclass(slots=True)
class SampledTokens:
    """One step's sampled tokens: rows in `req_ids` order, on the device or the host."""

    req_ids: list[str]
    tokens: torch.Tensor  # [S] int64
    logprobs: dict[str, dict[int, float]]


@dataclass(slots=True)
class _CudaStep:
    """A CUDA step split into its rows; `packed` once its inputs are on their way to the device."""

    decode: list[ScheduledRequest]
    prefill: list[ScheduledRequest]
    rows: np.ndarray  # decode_rows of `decode`, KV cache group 0's
    group_rows: list[np.ndarray]  # those of groups 1.. (a multi-group cache)
    packed: PackedStep | None = None


class PendingOutput:
    """A step the device may still be running. `result()` waits for it (one small copy, no other sync)."""

    def __init__(self, sampled: SampledTokens | None, connector_output: KVConnectorOutput | None) -> None:
        self._sampled = sampled
        self._connector_output = connector_output
        self._host: torch.Tensor | None = None
        self._event = None
        if sampled is not None and sampled.tokens.device.type == "cuda":
            self._host = torch.empty(sampled.tokens.shape, dtype=sampled.tokens.dtype, pin_memory=True)
            self._host.copy_(sampled.tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def connector_output(self) -> KVConnectorOutput | None:
        """The step's connector output (known at once: the worker half's step is synchronous)."""
        return self._connector_output

    def result(self) -> ModelRunnerOutput:
        s = self._sampled
        if s is None:
            return ModelRunnerOutput(connector_output=self._connector_output)
        if self._event is not None:
            self._event.synchronize()
            tokens = self._host.tolist()
        else:
            tokens = s.tokens.tolist()
        return ModelRunnerOutput(sampled=dict(zip(s.req_ids, tokens)), logprobs=s.logprobs,
                                 connector_output=self._connector_output)


class ModelRunner:
    """Executes scheduled steps on one model and its KV pages.

    `fast_paths`: what `models.fast_paths.apply_fast_paths` chose for the model (its fused
    kernels, packed weights and GEMM routes); when None the runner applies them itself, here,
    after the KV pages are sized. On the CUDA backend it also replays decode steps from CUDA
    graphs (`use_cuda_graphs`, on by default, a switch for tests and benchmarks).

    `batch_invariant` (CUDA): every step, decode ones too, asks for the row-invariant GEMMs for
    its projections and logits and runs its decode attention over fixed tiles
    (`attention.triton_tiles`), so a request's tokens and logprobs do not depend on what it is
    batched with. It is this runner's setting, passed with each step, never process state. The
    CPU path is batch-invariant either way.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_pages: KVPages,
        device: torch.device,
        fast_paths: FastPaths,
        connector: WorkerHalf | None = None,
        use_cuda_graphs: bool = True,
        max_model_len: int | None = None,
        backend: str = "auto",
        batch_invariant: bool = False,
        max_num_seqs: int = MAX_GRAPH_BATCH,
    ) -> None:
        self.model = model
        self.kv_pages = kv_pages
        self.device = device
        self.block_size = kv_pages.geometry.block_size
        self.connector = connector
        self._states: dict[str, _RequestState] = {}
        self._bitmasks: dict = {}  # this step's structured-output masks, by request id
        # The last step's samples, for the decode tokens of the next step under async scheduling.
        self._prev: SampledTokens | None = None
        self._prev_rows: dict[str, int] = {}
        self.hooks = _ConnectorLayerHooks(connector) if connector is not None else None
        if connector is not None:
            connector.register_kv_caches(kv_pages)
        geometry = kv_pages.geometry
        # fp8 pages hold another dtype than the model's activations, in which the kernels compute.
        model_dtype = model.model.embed_tokens.weight.dtype if kv_pages.quantized else None
        self.backend = "reference" if backend == "reference" else select_backend(
            device, kv_pages.tensor.dtype, geometry.head_dim, model_dtype)
        self.graphs = None
        self.prefill_graphs = None  # a step of one prompt token alone (`prefill_graphs`), with `graphs`
        self.staging = PinnedStaging(torch.int32) if device.type == "cuda" else None  # the packed steps' host side
        self.max_model_len = max_model_len
        self.batch_invariant = batch_invariant
        self.max_num_seqs = max_num_seqs
        layout = kv_pages.layout
        # Each KV cache group's window where its blocks behind it are freed (None: kept), and
        # each layer's group.
        self._group_windows = [g.sliding_window if layout.hybrid else None for g in layout.groups]
        self._layer_group = layout.layer_group
        if fast_paths.kernels == "triton" and self.backend != "cuda":
            raise ValueError(f"the model runs the CUDA fused kernels, the runner the {self.backend} attention backend")
        self.fast_paths = fast_paths
        # Whether the model computes the last layer for a step's sampled rows alone.
        self.sampled_rows_only = fast_paths.sampled_rows_only
        if self.backend == "cuda":
            # A model with MoE blocks runs every step eagerly (FastPaths.cuda_graphs).
            self._setup_cuda(use_cuda_graphs and fast_paths.cuda_graphs)

    def _setup_cuda(self, use_cuda_graphs: bool) -> None:
        from kvtool.engine.kernels.attention.triton_ops import choose_num_splits

        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        num_kv_heads = self.kv_pages.geometry.num_kv_heads
        self.num_splits_for = lambda batch, max_context: choose_num_splits(batch, num_kv_heads, max_context, num_sms)
        max_len = self.max_model_len or getattr(getattr(self.model, "config", None), "max_position_embeddings", 0) or 8192
        width = min(self.kv_pages.num_blocks, -(-max_len // self.block_size))
        # Eager decode splits as a graph of the same batch size does, so both compute alike.
        self.max_context = width * self.block_size
        if use_cuda_graphs:
            from kvtool.engine.worker.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_pages, min(MAX_GRAPH_BATCH, self.max_num_seqs), width,
                                       self.num_splits_for, self.batch_invariant)
        self._warm_up_prefill(num_sms)
        if self.graphs is not None:
            self.graphs.capture_all()
            from kvtool.engine.worker import prefill_graphs

            if prefill_graphs.supports(self.model, self.fast_paths):
                self.prefill_graphs = prefill_graphs.OneTokenPrefillGraphs(self.model, self.kv_pages)
                self.prefill_graphs.capture()

    def _warm_up_prefill(self, num_sms: int) -> None:
        """Run a few prefills once, so that their Triton kernels compile now rather than inside a
        first request: a full hit's one row and a partial hit's rows over a cached prefix, and one
        row count for every tile configuration of the row-invariant GEMMs below cuBLAS's rows
        (`warm_up_rows`), each with its logits. Their K/V land in page blocks no request holds yet."""
        from kvtool.engine.kernels.fp8_gemm import WARM_UP_ROWS
        from kvtool.engine.kernels.row_invariant_gemm import warm_up_rows

        bs = self.block_size
        # The projections' weight shapes (the LM head sees the sampled rows alone).
        weights = {tuple(p.shape) for name, p in self.model.named_parameters()
                   if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name}
        rows = set(warm_up_rows(weights, num_sms))
        if "fp8" in msgspec.structs.asdict(self.fast_paths.gemm).values():
            rows.update(WARM_UP_ROWS)
        shapes = [(1, bs), (bs + 1, bs)] + [(n, 0) for n in sorted(rows)]
        no_decode = decode_rows([], [], bs)
        # Every group's table is the same run of blocks, past the null block of a hybrid cache.
        first = NULL_BLOCK + 1 if self.kv_pages.layout.hybrid else 0
        for rows, prefix in shapes:
            blocks = -(-(prefix + rows) // bs)
            if first + blocks > self.kv_pages.num_blocks:
                continue
            s = ScheduledRequest(request_id="warm-up", token_ids=[0] * rows, start=prefix, new_block_ids=[], sample=True)
            table = [np.arange(first, first + blocks, dtype=np.int32)]
            more = [GroupInputs(no_decode, table) for _ in range(self.kv_pages.layout.num_groups - 1)]
            step = pack_step([], no_decode, [s], table, bs, self.device,
                             self.num_splits_for(0, self.max_context), self.batch_invariant, groups=more)
            meta = self._step_metadata(step, None, True)
            with attention_context(meta):
                hidden = self._sampled_hidden(step)
            self.model.compute_logits(hidden, row_invariant=self.batch_invariant)
        torch.cuda.synchronize(self.device)

    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's message to the runner's own batch state."""
        for rid in so.finished_req_ids:
            self._states.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._states.pop(rid, None)
        for new in so.new_requests:
            self._states[new.request_id] = _RequestState(
                sampling=new.sampling, seed=new.seed, num_prompt_tokens=len(new.prompt_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids, eos_token_ids=frozenset(new.eos_token_ids),
                tables=[_BlockTable() for _ in range(self.kv_pages.layout.num_groups)],
            )
        for s in so.scheduled:
            state = self._states[s.request_id]
            if s.new_block_ids or s.new_group_block_ids:
                state.add_blocks(s.new_block_ids, s.new_group_block_ids)
            if s.start + s.num_tokens > len(state.token_ids):
                state.see(s.start, s.token_ids)
        self._bitmasks = so.allowed_token_bitmasks

    @property
    def request_ids(self) -> list[str]:
        """Requests whose state the runner holds."""
        return list(self._states)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its result."""
        return self.execute_async(so).result()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        """Queue one step on the device and return without waiting for it (async scheduling).

        The step's decode tokens given as PLACEHOLDER_TOKEN are the previous step's samples,
        taken on the device; its own samples come back through `PendingOutput.result()`.
        """
        self._update_states(so)
        # A CUDA step's inputs go to the device before the connector queues its loads: copies
        # to the device run in the order they are queued, so an input copy queued after a load's
        # copies would hold the forward (and every layer a layerwise load has already delivered)
        # until the whole load is in.
        plan = self._plan_cuda(so) if self.backend == "cuda" and not so.is_empty else None
        if self.connector is not None and so.connector_meta is not None:
            self.connector.bind_connector_metadata(so.connector_meta)
            self.connector.start_load_kv()
        sampled = None
        if not so.is_empty:
            if plan is not None:
                sampled = self._run_cuda(plan)
            else:
                sampled = self._forward_and_sample(so)
        if sampled is not None:
            self._prev = sampled
            self._prev_rows = {rid: i for i, rid in enumerate(sampled.req_ids)}
        conn_out = None
        if self.connector is not None and so.connector_meta is not None:
            conn_out = self._finish_connector_step(so)
        return PendingOutput(sampled, conn_out)

    def _placeholder_rows(self, seqs: list[ScheduledRequest]) -> tuple[list[int], list[int]]:
        """(rows in `seqs`, rows in the previous samples) of the tokens to take from the previous step."""
        dst, src = [], []
        for i, s in enumerate(seqs):
            if s.token_ids[0] == PLACEHOLDER_TOKEN:
                dst.append(i)
                src.append(self._prev_rows[s.request_id])
        return dst, src

    def _resolve_placeholders_host(self, s: ScheduledRequest) -> list[int]:
        if s.token_ids[0] != PLACEHOLDER_TOKEN:
            return s.token_ids
        return [int(self._prev.tokens[self._prev_rows[s.request_id]])]

    def _patch_from_previous(self, target: torch.Tensor, dst: list[int], src: list[int]) -> None:
        """target[dst] = previous samples[src], on the device: the host never waits for them."""
        idx = torch.tensor([dst, src], dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        prev = self._prev.tokens.to(self.device, non_blocking=True)
        target.index_copy_(0, idx[0], prev.index_select(0, idx[1]).to(target.dtype))

    # ---- reference backend ---------------------------------------------------------------------

    def _forward_and_sample(self, so: SchedulerOutput) -> SampledTokens | None:
        bs = self.block_size
        windows = self._group_windows
        input_ids: list[int] = []
        positions: list[int] = []
        # Per KV cache group: the page block of each new token, and each sequence's table.
        slot_blocks: list[list[int]] = [[] for _ in windows]
        seqs: list[list[SeqSpan]] = [[] for _ in windows]
        slot_offsets: list[int] = []
        sample_rows: list[int] = []
        for s in so.scheduled:
            q_start = len(input_ids)
            ctx_len = s.start + s.num_tokens
            input_ids.extend(self._resolve_placeholders_host(s))
            pos = range(s.start, ctx_len)
            positions.extend(pos)
            slot_offsets.extend(p % bs for p in pos)
            for g, w in enumerate(windows):
                block_ids = self._states[s.request_id].tables[g].view[: -(-ctx_len // bs)]
                slot_blocks[g].extend(int(block_ids[p // bs]) for p in pos)
                if w is not None and s.start - w + 1 >= bs:
                    # Blocks behind the window may be freed (and reused): read the null block there.
                    block_ids = block_ids.copy()
                    block_ids[: (s.start - w + 1) // bs] = NULL_BLOCK
                table = torch.from_numpy(block_ids.astype(np.int64)).to(self.device)
                seqs[g].append(SeqSpan(q_start=q_start, q_len=s.num_tokens, ctx_len=ctx_len, block_ids=table))
            if s.sample:
                sample_rows.append(q_start + s.num_tokens - 1)
        dev = self.device
        offsets = torch.tensor(slot_offsets, dtype=torch.long, device=dev)
        metas = [
            AttentionMetadata(
                kv_pages=self.kv_pages,
                seqs=seqs[g],
                slot_block_ids=torch.tensor(slot_blocks[g], dtype=torch.long, device=dev),
                slot_offsets=offsets,
                hooks=self.hooks,
            )
            for g in range(len(windows))
        ]
        meta = metas[0]
        if len(metas) > 1:
            meta = replace(metas[0], group_metas=metas, layer_group=self._layer_group)
        self._order_page_writes(np.asarray([b for blocks in slot_blocks for b in blocks], dtype=np.int64))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        # On CPU the model computes the last layer (past storing every row's K/V) and the final
        # norm for the sampled rows only: a row's bits there do not depend on the rows computed
        # with it (`FastPaths.sampled_rows_only`). Elsewhere every row.
        rows_only = self.sampled_rows_only
        with attention_context(meta):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                rows if rows_only else None,
            )
        if not sample_rows:
            return None
        logits = self.model.compute_logits(hidden if rows_only else hidden.index_select(0, rows))
        return self._sample([s for s in so.scheduled if s.sample], logits)

    # ---- CUDA backend ------------------------------------------------------------------------------

    def _plan_cuda(self, so: SchedulerOutput) -> _CudaStep:
        """Split a step into decode and prefill rows; pack the inputs of a step that will run
        eagerly whatever the connector does (it computes prefill rows, or its decode batch has
        no captured graph)."""
        # A prompt row is a prefill row even alone (the one token a full hit computes, a 1-token
        # chunk): the prefill kernels give it the bits it has inside a whole-prompt prefill.
        decode = [s for s in so.scheduled if s.num_tokens == 1 and not self._is_prompt_row(s)]
        prefill = [s for s in so.scheduled if s.num_tokens > 1 or self._is_prompt_row(s)]
        rows = [decode_rows(decode, [self._states[s.request_id].tables[g].view for s in decode], self.block_size, w)
                for g, w in enumerate(self._group_windows)]
        plan = _CudaStep(decode, prefill, rows[0], rows[1:])
        if prefill or self.graphs is None or not self.graphs.fits(rows[0][:, 3]):
            plan.packed = self._pack(plan)
        return plan

    def _prefill_tables(self, prefill: list[ScheduledRequest], group: int) -> list[np.ndarray]:
        """The block tables of KV cache group `group` of the step's prefill sequences (the null
        block below a sliding window, `below_window`)."""
        w = self._group_windows[group]
        return [below_window(self._states[s.request_id].tables[group].view, s.start, w, self.block_size)
                for s in prefill]

    def _pack(self, plan: _CudaStep) -> PackedStep:
        groups = [GroupInputs(r, self._prefill_tables(plan.prefill, g)) for g, r in enumerate(plan.group_rows, 1)]
        return pack_step(
            plan.decode, plan.rows, plan.prefill, self._prefill_tables(plan.prefill, 0), self.block_size,
            self.device, self.num_splits_for(len(plan.decode), self.max_context), self.batch_invariant,
            self.staging, groups,
        )

    def _step_metadata(self, step: PackedStep, hooks, row_invariant: bool) -> AttentionMetadata:
        """The attention metadata of a packed step: its batch, and with several KV cache groups
        each group's (the layers attend with their group's, `AttentionMetadata.for_layer`)."""
        meta = AttentionMetadata(kv_pages=self.kv_pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 hooks=hooks, device_batch=step.batch, row_invariant=row_invariant)
        if step.group_batches is not None:
            meta.group_metas = [replace(meta, device_batch=b) for b in step.group_batches]
            meta.layer_group = self._layer_group
        return meta

    def _run_cuda(self, plan: _CudaStep) -> SampledTokens | None:
        decode, prefill, rows = plan.decode, plan.prefill, plan.rows
        hooks = self.hooks if self._layer_hooks_needed() else None
        dst, src = self._placeholder_rows(decode)
        if plan.packed is None and hooks is None:
            self._order_page_writes(np.concatenate([r[:, 2] for r in [rows, *plan.group_rows]]) // self.block_size)
            patch = (lambda ids: self._patch_from_previous(ids, dst, src)) if dst else None
            logits, greedy = self.graphs.run(rows, patch, plan.group_rows)
            sampled = [s for s in decode if s.sample]
            if len(sampled) < len(decode):
                keep = torch.tensor([i for i, s in enumerate(decode) if s.sample], dtype=torch.long, device=self.device)
                logits, greedy = logits.index_select(0, keep), greedy.index_select(0, keep)
            return self._sample(sampled, logits, greedy) if sampled else None

        step = plan.packed if plan.packed is not None else self._pack(plan)
        if dst:
            self._patch_from_previous(step.input_ids, dst, src)
        invariant = self.batch_invariant
        # Prefill rows always take the row-invariant GEMMs; decode rows in batch-invariant mode.
        meta = self._step_metadata(step, hooks, bool(prefill) or invariant)
        self._order_page_writes(step.written_blocks)
        if (self.prefill_graphs is not None and not decode and len(prefill) == 1 and prefill[0].num_tokens == 1
                and not self.kv_pages.scales_pending):  # the graphs store K/V under the scales they have
            hidden = self.prefill_graphs.run(step.input_ids, step.positions, meta)  # its one row
        else:
            with attention_context(meta):
                hidden = self._sampled_hidden(step)
        sampled = [s for s in decode if s.sample] + [s for s in prefill if s.sample]
        if not sampled:
            return None
        logits = self.model.compute_logits(hidden, row_invariant=invariant)
        return self._sample(sampled, logits)

    def _sampled_hidden(self, step: PackedStep) -> torch.Tensor:
        """The model's forward of a packed step (inside its attention context): the final hidden
        states of its sample rows, [S, hidden]. Where the model and the step allow it, the last
        layer computes those rows alone; otherwise every row, then the sample rows are taken."""
        if self.sampled_rows_only and step.batch.sampled is not None:
            return self.model(step.input_ids, step.positions, step.sample_rows)
        hidden = self.model(step.input_ids, step.positions)
        return hidden if hidden.shape[0] == step.sample_rows.shape[0] else hidden.index_select(0, step.sample_rows)

    def _is_prompt_row(self, s: ScheduledRequest) -> bool:
        """Whether the step's tokens for `s` start inside its prompt."""
        return s.start < self._states[s.request_id].num_prompt_tokens

    # ---- shared --------------------------------------------------------------------------------------

    def _layer_hooks_needed(self) -> bool:
        """Whether the connector needs its per-layer calls this step (then the forward runs eagerly)."""
        return self.connector is not None and self.connector.has_layer_work()

    def _order_page_writes(self, block_ids: np.ndarray) -> None:
        """Let a connector that still reads pages asynchronously order this step's writes after it."""
        if self.connector is not None:
            self.connector.order_page_writes(block_ids)

    def _sample(
        self, seqs: list[ScheduledRequest], logits: torch.Tensor, greedy: torch.Tensor | None = None
    ) -> SampledTokens:
        """Tokens for `seqs` from logits [N, V] (rows in order); `greedy` is their argmax if already known."""
        states = [self._states[s.request_id] for s in seqs]
        req_ids = [s.request_id for s in seqs]
        masks = self._bitmasks
        rows = []
        for s, st in zip(seqs, states):
            n = st.num_prompt_tokens
            # Only samplers that read the history get it (copying it for every row is the hot path's cost).
            history = st.sampling.samples_from_history
            rows.append(SampleRow(st.sampling, st.seed, st.token_ids[:n] if history else (),
                                  st.token_ids[n:] if history else (), st.eos_token_ids,
                                  masks.get(s.request_id), position=s.start + s.num_tokens - n))
        # On the device: the host reads the tokens only when the step's result is asked for.
        tokens, lps = sample_on_device(logits, rows, greedy)
        logprobs = {rid: lp for rid, lp in zip(req_ids, lps) if lp is not None}
        return SampledTokens(req_ids, tokens, logprobs)

    def _finish_connector_step(self, so: SchedulerOutput) -> KVConnectorOutput:
        c = self.connector
        assert c is not None
        c.wait_for_save()
        sending, recving = c.get_finished(so.finished_req_ids)
        errors = c.get_block_ids_with_load_errors()
        completions = c.take_completions()
        stats = c.take_stats()
        c.clear_connector_metadata()
        return KVConnectorOutput(
            step_id=so.step_id,
            finished_sending=sending or set(),
            finished_recving=recving or set(),
            invalid_block_ids=set(errors),
            invalid_reasons=dict(errors),
            completions=completions,
            stats=stats,
        )
