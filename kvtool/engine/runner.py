"""Runs one scheduled step: connector loads, the forward over the packed batch, sampling, stores."""

from __future__ import annotations

import torch
from torch import nn

from kvtool.engine.attention import AttentionMetadata, SeqSpan, attention_context
from kvtool.engine.connectors.base import KVConnectorOutput, WorkerHalf
from kvtool.engine.kv_pages import KVPages
from kvtool.engine.outputs import RunnerOutput, SchedulerOutput
from kvtool.engine.sampler import sample_tokens


class _ConnectorLayerHooks:
    """Routes the attention layers' per-layer calls to the connector's worker half."""

    def __init__(self, worker: WorkerHalf) -> None:
        self.worker = worker

    def before_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_layer(self, layer: int) -> None:
        self.worker.save_kv_layer(layer)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_pages: KVPages,
        device: torch.device,
        seed: int,
        connector: WorkerHalf | None = None,
    ) -> None:
        self.model = model
        self.kv_pages = kv_pages
        self.device = device
        self.block_size = kv_pages.geometry.block_size
        self.connector = connector
        self.generator = torch.Generator().manual_seed(seed)
        self.hooks = _ConnectorLayerHooks(connector) if connector is not None else None
        if connector is not None:
            connector.register_kv_caches(kv_pages)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        if self.connector is not None and so.connector_meta is not None:
            self.connector.bind_connector_metadata(so.connector_meta)
            self.connector.start_load_kv()
        sampled: dict[str, int] = {}
        logprobs: dict[str, dict[int, float]] = {}
        if not so.is_empty:
            sampled, logprobs = self._forward_and_sample(so)
        conn_out = None
        if self.connector is not None and so.connector_meta is not None:
            conn_out = self._finish_connector_step(so)
        return RunnerOutput(sampled=sampled, logprobs=logprobs, connector_output=conn_out)

    def _forward_and_sample(self, so: SchedulerOutput) -> tuple[dict[str, int], dict[str, dict[int, float]]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        seqs: list[SeqSpan] = []
        sample_rows: list[int] = []
        for s in so.scheduled:
            q_start = len(input_ids)
            ctx_len = s.start + s.num_tokens
            input_ids.extend(s.token_ids)
            pos = range(s.start, ctx_len)
            positions.extend(pos)
            slot_blocks.extend(s.block_ids[p // bs] for p in pos)
            slot_offsets.extend(p % bs for p in pos)
            table = torch.tensor(s.block_ids[: -(-ctx_len // bs)], dtype=torch.long, device=self.device)
            seqs.append(SeqSpan(q_start=q_start, q_len=s.num_tokens, ctx_len=ctx_len, block_ids=table))
            if s.sample:
                sample_rows.append(q_start + s.num_tokens - 1)
        dev = self.device
        meta = AttentionMetadata(
            kv_pages=self.kv_pages,
            seqs=seqs,
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            hooks=self.hooks,
        )
        with attention_context(meta):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
            )
        if not sample_rows:
            return {}, {}
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        to_sample = [s for s in so.scheduled if s.sample]
        tokens, lps = sample_tokens(
            logits, [s.sampling for s in to_sample], [s.generator for s in to_sample], self.generator
        )
        sampled = {s.request_id: t for s, t in zip(to_sample, tokens)}
        logprobs = {s.request_id: lp for s, lp in zip(to_sample, lps) if lp is not None}
        return sampled, logprobs

    def _finish_connector_step(self, so: SchedulerOutput) -> KVConnectorOutput:
        c = self.connector
        assert c is not None
        c.wait_for_save()
        sending, recving = c.get_finished(so.finished_req_ids)
        errors = c.get_block_ids_with_load_errors()
        stats = c.take_stats()
        c.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=sending or set(),
            finished_recving=recving or set(),
            invalid_block_ids=set(errors),
            invalid_reasons=dict(errors),
            stats=stats,
        )
