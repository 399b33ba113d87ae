"""`kvtool model create`: write a preset as a real Hugging Face model directory."""

from pathlib import Path
from typing import Annotated

import typer

from kvtool.commands import render
from kvtool.commands.options import JsonOpt
from kvtool.engine.presets.catalog import PRESET_NAMES, create_model_dir


def model_create(
    dir: Annotated[Path, typer.Argument(help="Directory to create (absent or empty).")],
    preset: Annotated[str, typer.Option("--preset", help=f"One of: {', '.join(PRESET_NAMES)}.")],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random weights (random presets).")] = 0,
    config_only: Annotated[
        bool, typer.Option("--config-only", help="Write config and tokenizer only (for --load-format dummy).")
    ] = False,
    json: JsonOpt = False,
) -> None:
    """Write a model directory that kvtool and transformers both load.

    Examples:

        kvtool model create ./tiny --preset tiny --seed 1

        kvtool model create ./llama8b --preset llama-3.1-8b --config-only

        kvtool model create ./smollm2 --preset smollm2-135m-instruct
    """
    with render.progress_bar(f"Creating {preset}", enabled=not json) as bar:
        announced: list[bool] = []

        def progress(stage: str, fraction: float) -> None:
            if not announced and stage != "random weights" and not json:
                announced.append(True)
                render.info("Preparing the embedded default model SmolLM2-135M-Instruct (once per user)...")
            bar(stage, fraction)

        created = create_model_dir(dir, preset, seed=seed, config_only=config_only, progress=progress)
    if json:
        render.print_json(created)
        return
    what = f"{created.num_parameters / 1e6:,.1f}M parameters"
    weights = "config and tokenizer only" if created.config_only else f"{created.num_bytes / 1e6:,.1f} MB"
    seeded = f", seed {created.seed}" if created.seed is not None and not created.config_only else ""
    render.stdout.print(
        f"created {created.preset} in {created.path}: {created.architecture}, {what}, {weights}{seeded}",
        highlight=False,
    )
