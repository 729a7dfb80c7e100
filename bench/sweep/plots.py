"""PNG plots of a sweep with matplotlib (Agg: no display needed): against concurrency (closed
loop) and against the offered request rate (open loop: throughput and latency against load, as
GuideLLM and AIPerf plot them), one figure per measure, one panel per input length, one line
per target (medians over repeats).
"""

from __future__ import annotations

from pathlib import Path

from bench.sweep.models import SummaryRow, SweepConfig
from tools.fileio import write_atomic

PLOTS = [
    ("output_tok_s", "output tok/s", "throughput.png"),
    ("per_stream_tok_s", "per-stream tok/s (1000 / median TPOT)", "per_stream.png"),
    ("ttft_p50_ms", "TTFT p50 (ms)", "ttft.png"),
]
RATE_PLOTS = [
    (("req_s", "achieved_rate"), "completed / achieved req/s", "rate_throughput.png"),
    (("ttft_p50_ms", "e2e_p50_ms"), "TTFT p50 / E2E p50 (ms)", "rate_latency.png"),
]


def save(fig, path: Path) -> str:
    """The figure as a PNG, written atomically; closes it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return str(path)


def make_plots(
    config: SweepConfig, rows: list[SummaryRow], out_dir: Path
) -> tuple[list[str], str | None]:
    """(written PNG paths, None) or ([], why there are no plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [], f"matplotlib is not installed ({exc}): pip install matplotlib"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    labels = [t.label for t in config.targets]
    lens = config.input_lens
    closed = sorted({r.concurrency for r in rows if r.rate is None})
    for field, title, name in PLOTS if closed else []:
        fig, axes = plt.subplots(1, len(lens), figsize=(5 * len(lens), 4), squeeze=False)
        for ax, n in zip(axes[0], lens, strict=True):
            for label in labels:
                xs, ys = [], []
                for row in rows:
                    if row.input_len != n or row.rate is not None:
                        continue
                    tc = next(t for t in row.targets if t.target == label)
                    value = getattr(tc, field)
                    if value is not None:
                        xs.append(row.concurrency)
                        ys.append(value)
                ax.plot(xs, ys, marker="o", label=label)
            ax.set_title(f"input {n} tokens, output {config.output_len}")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(title)
            ax.set_xscale("log", base=2)
            ax.set_xticks(closed, [str(c) for c in closed])
            ax.set_ylim(bottom=0)  # a flat line must look flat, not zoomed into noise
            ax.grid(True, alpha=0.3)
            ax.legend()
        written.append(save(fig, out_dir / name))
    if any(r.rate is not None for r in rows):
        written += rate_plots(config, rows, out_dir, plt)
    return written, None


def rate_plots(config: SweepConfig, rows: list[SummaryRow], out_dir: Path, plt) -> list[str]:
    """Throughput and latency against the offered rate (the diagonal: a server keeping up)."""
    labels = [t.label for t in config.targets]
    lens = config.input_lens
    written = []
    for (first, second), title, name in RATE_PLOTS:
        fig, axes = plt.subplots(1, len(lens), figsize=(5 * len(lens), 4), squeeze=False)
        for ax, n in zip(axes[0], lens, strict=True):
            offered = sorted({r.rate for r in rows if r.input_len == n and r.rate is not None})
            if first == "req_s" and offered:
                ax.plot(offered, offered, linestyle=":", color="grey", label="offered")
            for label in labels:
                for field, style in ((first, "-"), (second, "--")):
                    xs, ys = [], []
                    for row in rows:
                        if row.input_len != n or row.rate is None:
                            continue
                        tc = next(t for t in row.targets if t.target == label)
                        if getattr(tc, field) is not None:
                            xs.append(row.rate)
                            ys.append(getattr(tc, field))
                    ax.plot(xs, ys, style, marker="o", label=f"{label} {field}")
            ax.set_title(f"input {n} tokens, output {config.output_len}")
            ax.set_xlabel("offered request rate (req/s)")
            ax.set_ylabel(title)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        written.append(save(fig, out_dir / name))
    return written
