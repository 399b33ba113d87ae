"""Random-weight directories of the sliding-window presets (Gemma 3, Gemma 2, a windowed Mistral)
with a short window, which the KV cache group tests run on."""

from __future__ import annotations

from pathlib import Path

WINDOW_PRESETS = ["tiny-gemma3", "tiny-gemma2", "tiny-mistral"]


def window_model_dir(root: Path, name: str, window: int = 32, seed: int = 5) -> Path:
    """`name`'s preset under `root`, its `sliding_window` set to `window`."""
    from kvtool.engine.presets.catalog import PRESETS, write_random_model_dir

    preset = PRESETS[name]
    d = root / name
    write_random_model_dir(d, {**preset.hf_config, "sliding_window": window}, seed=seed, tokenizer=preset.tokenizer)
    return d
