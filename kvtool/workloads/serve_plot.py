"""The figure of `kvtool bench serve --plot`: TTFT p50, TTFT p99 and output throughput against
the offered load, one line per arm.

The loads sit on the x axis in the order of their rates (numbers ascending, then `inf`, then
`trace`), evenly spaced and labelled as given. A point whose queue grew over the run is drawn
hollow: that load was past what the arm sustains. TTFT is on a log scale.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.workloads.serve_bench import ServeReport


def _load_order(label: str, rate: float | None) -> tuple[int, float]:
    return (0, rate) if rate is not None else (1 if label == "inf" else 2, 0.0)


def plot_serve(report: ServeReport, path: str | Path) -> None:
    """Write the figure as PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    loads = sorted({(r.load, r.request_rate) for r in report.runs}, key=lambda x: _load_order(*x))
    x_of = {label: i for i, (label, _) in enumerate(loads)}
    arms = list(dict.fromkeys(r.arm for r in report.runs))
    panels = (("TTFT p50 (ms)", lambda r: r.figures.ttft.p50_ms, True),
              ("TTFT p99 (ms)", lambda r: r.figures.ttft.p99_ms, True),
              ("output throughput (tok/s)", lambda r: r.figures.output_tokens_per_s, False))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for ax, (title, value, log_scale) in zip(axes, panels):
        for k, arm in enumerate(arms):
            runs = sorted((r for r in report.runs if r.arm == arm and value(r) is not None), key=lambda r: x_of[r.load])
            if not runs:
                continue
            color = f"C{k % 10}"
            style = "--" if runs[0].engine == "vllm" else "-"
            ax.plot([x_of[r.load] for r in runs], [value(r) for r in runs], style, color=color, label=arm)
            for r in runs:
                grew = r.figures.queue.grew is True
                ax.plot(x_of[r.load], value(r), "o", color=color, markerfacecolor="white" if grew else color)
        ax.set_xticks(range(len(loads)), labels=[label for label, _ in loads])
        ax.set(xlabel="offered load (requests/s)", ylabel=title, title=title)
        if log_scale:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            # Label 2x and 5x minor ticks only, so that a log axis stays readable.
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.grid(True, which="both", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize="small")
    conc = f", at most {report.settings.max_concurrency} in flight" if report.settings.max_concurrency else ""
    fig.suptitle(f"kvtool bench serve: {Path(report.settings.trace).name}, {report.num_requests} requests{conc}; "
                 f"{Path(report.model).name} on {report.machine}; KV {report.sizes.kv_capacity_tokens} tokens, working "
                 f"set {report.sizes.working_set_tokens} ({report.sizes.kv_pressure:g}x); hollow: queue grew",
                 fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
