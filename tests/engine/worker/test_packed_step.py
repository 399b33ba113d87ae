"""The one int32 buffer a CUDA step's inputs travel in (`pack_step`): every segment holds its
values and starts 16 bytes aligned, whatever the step's row counts (Triton compiles a kernel
variant per pointer alignment, so unaligned views would compile new variants mid-request).
Runs on the CPU: the packing is host work; only the copy's destination is the device."""

import numpy as np
import torch

from kvtool.engine.core.messages import ScheduledRequest
from kvtool.engine.worker.model_runner import decode_rows, pack_step

BS = 16


def _step(monkeypatch, num_decode, prompt_len, prefix, tiles):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no device here
    decode = [ScheduledRequest(request_id=f"d{i}", token_ids=[5 + i], start=20 + 7 * i, new_block_ids=[], sample=True)
              for i in range(num_decode)]
    tables = [np.arange(10 * i, 10 * i + 4, dtype=np.int32) for i in range(num_decode)]
    rows = decode_rows(decode, tables, BS)
    prefill = [ScheduledRequest(request_id="p", token_ids=list(range(100, 100 + prompt_len)), start=prefix,
                                new_block_ids=[], sample=True)]
    table = np.arange(200, 200 + -(-(prefix + prompt_len) // BS), dtype=np.int32)
    return pack_step(decode, rows, prefill, [table], BS, torch.device("cpu"), 1, tiles), table


def test_segments_hold_their_values_and_start_16_bytes_aligned(monkeypatch):
    for num_decode, prompt_len, prefix, tiles in ((0, 1, 16, False), (3, 7, 16, True), (1, 5, 0, True),
                                                  (2, 37, 33, False), (5, 1, 8192, True)):
        step, table = _step(monkeypatch, num_decode, prompt_len, prefix, tiles)
        batch, pre = step.batch, step.batch.prefill
        ctx = prefix + prompt_len
        views = [step.input_ids, step.positions, batch.slot_mapping, pre.cu_q, pre.cu_k, step.sample_rows]
        views += [batch.context_lens, batch.decode_order] if num_decode else []
        views += [pre.key_slots] if prefix else []
        views += [batch.tile_base] if tiles and num_decode else []
        assert all(v.data_ptr() % 16 == 0 for v in views), (num_decode, prompt_len, prefix, tiles)
        assert step.input_ids.tolist() == [5 + i for i in range(num_decode)] + list(range(100, 100 + prompt_len))
        positions = list(range(prefix, ctx))
        assert step.positions.tolist()[num_decode:] == positions
        assert batch.slot_mapping.tolist()[num_decode:] == [int(table[p // BS]) * BS + p % BS for p in positions]
        assert pre.cu_q.tolist() == [0, prompt_len] and pre.cu_k.tolist() == [0, ctx]
        if prefix:
            assert pre.key_slots.tolist() == [int(table[p // BS]) * BS + p % BS for p in range(ctx)]
        assert step.sample_rows.tolist() == list(range(num_decode)) + [num_decode + prompt_len - 1]
        assert batch.context_lens.tolist() == [21 + 7 * i for i in range(num_decode)]
        assert batch.sampled is None or batch.sampled.prefill.cu_q.data_ptr() % 16 == 0


def _request(rid, n, start, sample):
    return ScheduledRequest(request_id=rid, token_ids=list(range(1, n + 1)), start=start, new_block_ids=[],
                            sample=sample)


def test_the_sampled_batch_takes_the_sample_rows_as_its_queries(monkeypatch):
    """A step that computes prefill rows it does not sample carries the batch of its sample rows
    (the last layer's): every decode row, then one row per sampling prefill sequence over that
    sequence's keys; the key layout and the decode rows are the step's own."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    decode = [_request(f"d{i}", 1, 30 + i, True) for i in range(2)]
    prefill = [_request("a", 40, 0, True), _request("b", 23, 16, False), _request("c", 9, 32, True)]
    d_tables = [np.arange(4 * i, 4 * i + 4, dtype=np.int32) for i in range(2)]
    p_tables = [np.arange(20 + 5 * j, 25 + 5 * j, dtype=np.int32) for j in range(3)]
    step = pack_step(decode, decode_rows(decode, d_tables, BS), prefill, p_tables, BS, torch.device("cpu"), 1, True)
    batch = step.batch
    sampled = batch.sampled
    assert step.sample_rows.tolist() == [0, 1, 2 + 39, 2 + 40 + 23 + 8]
    assert sampled.num_decode == 2 and sampled.slot_mapping is batch.slot_mapping
    assert sampled.block_table is batch.block_table and sampled.tile_base is batch.tile_base
    pre = sampled.prefill
    assert (pre.q_start, pre.max_q, pre.max_k) == (2, 1, 41)
    assert pre.cu_q.tolist() == [0, 1, 1, 2]  # the chunk of "b" samples nothing: no query row
    assert pre.cu_k is batch.prefill.cu_k and pre.key_slots is batch.prefill.key_slots
    assert batch.prefill.cu_q.tolist() == [0, 40, 63, 72]


def test_steps_whose_rows_are_all_sampled_or_with_an_unsampled_decode_row_have_no_sampled_batch(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    cpu = torch.device("cpu")
    table = [np.arange(8, dtype=np.int32)]
    none = decode_rows([], [], BS)
    # one prompt token alone, two one-token prompt rows: every row is a sample row
    assert pack_step([], none, [_request("a", 1, 40, True)], table, BS, cpu, 1).batch.sampled is None
    assert pack_step([], none, [_request("a", 1, 40, True), _request("b", 1, 7, True)], table * 2, BS, cpu,
                     1).batch.sampled is None
    # decode rows only: nothing to skip
    decode = [_request("d", 1, 30, True)]
    assert pack_step(decode, decode_rows(decode, table, BS), [], [], BS, cpu, 1).batch.sampled is None
    # a decode row that samples nothing keeps every row
    decode = [_request("d", 1, 30, False)]
    step = pack_step(decode, decode_rows(decode, table, BS), [_request("a", 9, 0, True)], table, BS, cpu, 1)
    assert step.batch.sampled is None
    # a chunk that samples nothing: the sampled batch has no prefill rows at all
    step = pack_step([], none, [_request("a", 50, 0, False)], table, BS, cpu, 1)
    assert step.batch.sampled is not None and step.batch.sampled.prefill is None
    assert step.sample_rows.numel() == 0


def test_each_kv_cache_group_gets_its_slots_table_and_key_slots_over_the_shared_rows(monkeypatch):
    """A step of a two-group cache (group 0 sliding, window 40; group 1 full attention): each
    group's batch holds that group's slots of the new tokens, its decode table (the null block
    below the window in the sliding group's) and its prefix key slots; the token ids, positions,
    context lengths and launch order are one set of views, and the written blocks are both groups'."""
    from kvtool.engine.core.block_pool import NULL_BLOCK
    from kvtool.engine.worker.cuda_step import GroupInputs, below_window

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    window = 40
    decode = [_request("d0", 1, 70, True), _request("d1", 1, 20, True)]
    prefill = [_request("p", 30, 64, True)]  # rows at 64..93: the window reaches back to 25
    sliding = {"d0": np.arange(10, 15, dtype=np.int32), "d1": np.arange(20, 22, dtype=np.int32),
               "p": np.arange(30, 36, dtype=np.int32)}
    full = {k: v + 100 for k, v in sliding.items()}
    rows0 = decode_rows(decode, [sliding["d0"], sliding["d1"]], BS, window)
    rows1 = decode_rows(decode, [full["d0"], full["d1"]], BS)
    # d0 decodes position 70: keys 31..70, so block 0 (keys 0..15) is behind the window, block 1 is not.
    assert rows0[0, 4:].tolist() == [NULL_BLOCK, 11, 12, 13, 14] and rows0[1, 4:6].tolist() == [20, 21]
    assert rows1[0, 4:].tolist() == [110, 111, 112, 113, 114]
    p_table = below_window(sliding["p"], 64, window, BS)
    assert p_table.tolist() == [NULL_BLOCK, 31, 32, 33, 34, 35] and sliding["p"][0] == 30  # a copy
    step = pack_step(decode, rows0, prefill, [p_table], BS, torch.device("cpu"), 1, True,
                     groups=[GroupInputs(rows1, [full["p"]])])
    b0, b1 = step.group_batches
    assert b0 is step.batch and all(b.context_lens is b0.context_lens for b in (b0, b1))
    assert b1.decode_order is b0.decode_order and b1.tile_base is b0.tile_base
    assert b1.prefill.cu_q is b0.prefill.cu_q and b1.prefill.cu_k is b0.prefill.cu_k

    def slot(table, p):
        return int(table[p // BS]) * BS + p % BS

    new = list(range(64, 94))
    assert b0.slot_mapping.tolist() == [slot(sliding["d0"], 70), slot(sliding["d1"], 20)] + [
        slot(sliding["p"], p) for p in new]
    assert b1.slot_mapping.tolist() == [slot(full["d0"], 70), slot(full["d1"], 20)] + [slot(full["p"], p) for p in new]
    assert b0.block_table.tolist() == rows0[:, 4:].tolist() and b1.block_table.tolist() == rows1[:, 4:].tolist()
    assert b0.prefill.key_slots.tolist() == [slot(p_table, k) for k in range(94)]
    assert b1.prefill.key_slots.tolist() == [slot(full["p"], k) for k in range(94)]
    views = [b.slot_mapping for b in (b0, b1)] + [b.block_table for b in (b0, b1)]
    views += [b.prefill.key_slots for b in (b0, b1)]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    written = set(step.written_blocks.tolist())
    assert written == {14, 21, 34, 35, 114, 121, 134, 135}
    # one group: no per-group batches
    assert pack_step(decode, rows1, prefill, [full["p"]], BS, torch.device("cpu"), 1).group_batches is None
