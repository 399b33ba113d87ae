"""KV pages: block-major layout, KV_2LTD gather/scatter, geometry refusal."""

import pytest
import torch

from kvtool.engine.errors import KVRefused
from kvtool.engine.kv.pages import KVGeometry, KVPages, refuse_geometry_mismatch


def _pages(num_blocks=6, block_size=4):
    g = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=5, block_size=block_size, dtype="float32")
    pages = KVPages(g, num_blocks, torch.device("cpu"))
    pages.tensor.copy_(torch.arange(pages.tensor.numel(), dtype=torch.float32).reshape(pages.tensor.shape))
    return pages


def test_block_is_contiguous_and_kv_2ltd_order():
    pages = _pages()
    g = pages.geometry
    block = pages.tensor[2]
    assert block.is_contiguous() and block.numel() * 4 == g.bytes_per_block
    out = pages.gather([2], "KV_2LTD")
    assert out.shape == (2, 3, 4, 10)
    # For one block the KV_2LTD bytes are the block's bytes as they are.
    assert torch.equal(out.flatten(), block.flatten())


def test_gather_scatter_round_trip_partial():
    src = _pages()
    data = src.gather([1, 4, 3], "KV_2LTD", num_tokens=10)
    assert data.shape == (2, 3, 10, 10)
    dst = KVPages(src.geometry, 6, torch.device("cpu"))
    dst.tensor.zero_()
    dst.scatter([0, 5, 2], data, "KV_2LTD", num_tokens=10)
    assert torch.equal(dst.gather([0, 5, 2], "KV_2LTD", num_tokens=10), data)
    assert torch.equal(dst.tensor[0], src.tensor[1])
    # Token 10 and 11 of the last block were not written.
    assert torch.equal(dst.tensor[2][:, :, :2], src.tensor[3][:, :, :2])
    assert torch.all(dst.tensor[2][:, :, 2:] == 0)


def test_block_major_round_trip():
    src = _pages()
    blocks = src.gather([5, 0], "block_major")
    dst = KVPages(src.geometry, 6, torch.device("cpu"))
    dst.scatter([1, 2], blocks)
    assert torch.equal(dst.tensor[1], src.tensor[5]) and torch.equal(dst.tensor[2], src.tensor[0])


def test_geometry_mismatch_names_both():
    a = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=5, block_size=4, dtype="float32")
    b = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=5, block_size=4, dtype="bfloat16")
    with pytest.raises(KVRefused) as e:
        refuse_geometry_mismatch(a, b, "load")
    assert "num_layers" in str(e.value) and "dtype" in str(e.value) and "layers=3" in str(e.value)
