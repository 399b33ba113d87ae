"""An FP8 checkpoint weight in the form `kernels.fp8_gemm` multiplies by (no Triton here: the
models import it on every device)."""

from __future__ import annotations

from typing import NamedTuple

import torch

# Activation quantisation group and the kernel's K step.
GROUP = 128


class Fp8Weight(NamedTuple):
    """A projection's FP8 weight for `fp8_gemm.fp8_mm`.

    data   float8_e4m3fn [N, K]
    scale  float32 [ceil(N / scale_rows), ceil(K / scale_cols)], or [ceil(N / scale_rows), 1]
           for one scale over all of K
    """

    data: torch.Tensor
    scale: torch.Tensor
    scale_rows: int  # output rows per scale row: a block's height, or 1
    scale_cols: int  # input columns per scale column: a block's width (a multiple of GROUP)


def block_fits(block_k: int) -> bool:
    """Whether block scales whose K side is `block_k` wide fit the kernel's K step."""
    return block_k % GROUP == 0


def supported_device(device: torch.device) -> bool:
    """Whether `device` has FP8 tensor cores (compute capability 8.9 and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def per_row(w: Fp8Weight) -> Fp8Weight:
    """`w` with one scale row per output row (block scales repeated down their block)."""
    if w.scale_rows == 1:
        return w
    scale = w.scale.repeat_interleave(w.scale_rows, dim=0)[: w.data.shape[0]].contiguous()
    return Fp8Weight(w.data, scale, 1, w.scale_cols)


def concat(weights: list[Fp8Weight]) -> Fp8Weight:
    """The weights stacked along N for one product (q/k/v, gate/up): block scales are kept where
    every part's rows fill whole blocks of one shape, else each part's scales go per row."""
    first = weights[0]
    if any(w.data.shape[1] != first.data.shape[1] for w in weights):
        raise ValueError("FP8 weights of different input widths cannot be stacked")
    same = all(w.scale_rows == first.scale_rows and w.scale_cols == first.scale_cols
               and w.scale.shape[1] == first.scale.shape[1] for w in weights)
    if not same or any(w.data.shape[0] % w.scale_rows for w in weights[:-1]):
        weights = [per_row(w) for w in weights]
        widths = {w.scale.shape[1] for w in weights}
        if len(widths) > 1:  # a part with one scale over K beside one with groups: spread it
            cols = max(widths)
            weights = [w._replace(scale=w.scale.expand(-1, cols).contiguous(),
                                  scale_cols=max(x.scale_cols for x in weights)) for w in weights]
    data = torch.cat([w.data for w in weights])
    scale = torch.cat([w.scale for w in weights])
    return Fp8Weight(data, scale, weights[0].scale_rows, weights[0].scale_cols)
