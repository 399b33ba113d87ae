"""The figure of `kvtool bench ttft --plot`: TTFT and speed-up against prompt length, per arm.

One row per hit fraction. Left: median TTFT (ms, log scale) against prompt length (log scale),
one line per arm and concurrency. Right: the `none` arm's TTFT over each arm's (log scale; above
1 is faster than computing everything). Invalid cells are left out: they have no number.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.workloads.ttft import TTFTReport


def plot_ttft(report: TTFTReport, path: str | Path) -> None:
    """Write the figure as PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, NullFormatter

    fractions = sorted({c.hit_fraction for c in report.cells})
    lengths = sorted({c.prompt_len for c in report.cells})
    concurrencies = sorted({c.concurrency for c in report.cells})
    arms = list(dict.fromkeys(c.arm for c in report.cells))
    styles = ["-", "--", ":", "-."]
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(len(fractions), 2, figsize=(12, 3.6 * len(fractions)), squeeze=False)
    for row, f in enumerate(fractions):
        ax_ttft, ax_speed = axes[row]
        for arm in arms:
            for k, conc in enumerate(concurrencies):
                cells = sorted(
                    (c for c in report.cells if c.arm == arm and c.hit_fraction == f and c.concurrency == conc
                     and c.ttft_ms is not None),
                    key=lambda c: c.prompt_len,
                )
                if not cells:
                    continue
                label = arm if len(concurrencies) == 1 else f"{arm}, c={conc}"
                style = dict(color=colors[arm], linestyle=styles[k % len(styles)], marker="o")
                ax_ttft.plot([c.prompt_len for c in cells], [c.ttft_ms.median_ms for c in cells], label=label, **style)
                sped = [c for c in cells if c.speedup_vs_none is not None]
                if sped and arm != "none":
                    ax_speed.plot([c.prompt_len for c in sped], [c.speedup_vs_none for c in sped], label=label, **style)
        ax_ttft.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="TTFT median (ms)",
                    title=f"TTFT, hit fraction {f:g}")
        ax_speed.axhline(1.0, color="grey", linewidth=0.8)
        ax_speed.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="speed-up vs none (x)",
                     title=f"speed-up over computing everything, hit fraction {f:g}")
        for ax in (ax_ttft, ax_speed):
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xticks(lengths, labels=[str(n) for n in lengths])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            # Label 2x and 5x minor ticks only, so that a log axis stays readable.
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
            if row == 0 and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
    num_invalid = sum(not c.valid for c in report.cells)
    fig.suptitle(f"kvtool bench ttft: {Path(report.model).name} on {report.device} ({report.dtype})"
                 + (f"; {num_invalid} invalid cell(s) left out" if num_invalid else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
