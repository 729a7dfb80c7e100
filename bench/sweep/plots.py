"""PNG plots of a sweep with matplotlib (Agg: no display needed): against concurrency, one
figure per measure, one panel per input length, one line per target (medians over repeats).
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
    import io

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    labels = [t.label for t in config.targets]
    lens = config.input_lens
    for field, title, name in PLOTS:
        fig, axes = plt.subplots(1, len(lens), figsize=(5 * len(lens), 4), squeeze=False)
        for ax, n in zip(axes[0], lens, strict=True):
            for label in labels:
                xs, ys = [], []
                for row in rows:
                    if row.input_len != n:
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
            ax.set_xticks(config.concurrency, [str(c) for c in config.concurrency])
            ax.set_ylim(bottom=0)  # a flat line must look flat, not zoomed into noise
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        path = out_dir / name
        write_atomic(path, buf.getvalue())
        written.append(str(path))
    return written, None
