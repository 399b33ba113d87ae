"""The one int32 buffer a CUDA step's inputs travel in (`pack_step`): every segment holds its
values and starts 16 bytes aligned, whatever the step's row counts (Triton compiles a kernel
variant per pointer alignment, so unaligned views would compile new variants mid-request).
Runs on the CPU: the packing is host work; only the copy's destination is the device."""

import numpy as np
import torch

from kvtool.engine.messages import ScheduledRequest
from kvtool.engine.runner import decode_rows, pack_step

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
