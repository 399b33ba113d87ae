"""Model presets (`kvtool model create`) and the embedded default model."""
