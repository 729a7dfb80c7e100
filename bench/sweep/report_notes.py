"""The notes under a sweep report's tables: output counts a driver could not take from the
server, GPU throttling and utilization, the servers' CPU, batching, prefix-cache hits."""

from __future__ import annotations

from bench.sweep.models import CellRecord
from engine.step_clock import HOST_PHASES


def count_notes(cells: list[CellRecord]) -> list[str]:
    """Cells whose output token counts exceed what the requests allowed (max_tokens with
    ignore_eos): the count is the client's re-tokenization of the text, so tok/s overstates."""
    long = [c for c in cells if c.long_outputs]
    if not long:
        return []
    names = ", ".join(c.key().name() for c in long[:4]) + (" ..." if len(long) > 4 else "")
    n = sum(c.long_outputs for c in long)
    return [
        f"{n} completed requests in {len(long)} cells ({names}) were counted with more output "
        "tokens than max_tokens allows: the driver counted the text re-tokenized, not the "
        "server's tokens (vllm bench serve reads usage only from a chunk without choices; "
        "llama-server sends it with the last choice), so their output tok/s overstate; the "
        "builtin driver counts the server's usage."
    ]


def telemetry_notes(cells: list[CellRecord]) -> list[str]:
    notes: list[str] = count_notes(cells)
    missing = {c.telemetry.gpu_missing for c in cells if c.telemetry.gpu_missing}
    if missing:
        notes.append(f"No GPU telemetry: {'; '.join(sorted(missing))}.")
    for c in cells:
        g = c.telemetry.gpu
        if g is None:
            continue
        busy = {k: v for k, v in g.throttle.items() if v >= 0.2 and k != "gpu_idle"}
        if busy:
            what = ", ".join(f"{k} {v:.0%} of samples" for k, v in busy.items())
            clock = f"SM clock at {g.clock_share:.0%} of max" if g.clock_share else ""
            notes.append(f"{c.key().name()}: throttled ({what}) {clock}".rstrip())
    gpus: dict[str, list] = {}
    for c in cells:
        if c.telemetry.gpu is not None:
            gpus.setdefault(c.target, []).append(c.telemetry.gpu)
    for t, gs in gpus.items():
        util = [g.util_max for g in gs if g.util_max is not None]
        clock = [g.clock_share for g in gs if g.clock_share is not None]
        power = [g.power_mean_w for g in gs if g.power_mean_w is not None]
        limit = next((g.power_limit_w for g in gs if g.power_limit_w), None)
        notes.append(
            f"{t}: {gs[0].name or 'GPU'} utilization up to {max(util, default=0):.0f}%, SM clock "
            f"{min(clock, default=0):.0%}-{max(clock, default=0):.0%} of max, power up to "
            f"{max(power, default=0):.0f} W"
            + (f" of {limit:.0f} W" if limit else "")
            + f" ({sum(g.samples for g in gs)} samples)."
        )
    cpu = [c for c in cells if c.telemetry.server_cpu_cores is not None]
    if cpu:
        by_target: dict[str, list[float]] = {}
        for c in cpu:
            by_target.setdefault(c.target, []).append(c.telemetry.server_cpu_cores or 0.0)
        for t, xs in by_target.items():
            notes.append(f"{t}: server process CPU {min(xs):.2f}-{max(xs):.2f} cores during cells.")
    batched = [c for c in cells if c.telemetry.decode_rows_per_step is not None]
    if batched:
        per: dict[tuple[str, int], list[float]] = {}
        for c in batched:
            per.setdefault((c.target, c.concurrency), []).append(c.telemetry.decode_rows_per_step)
        parts = [f"{t} c={conc}: {max(xs):.1f}" for (t, conc), xs in sorted(per.items())]
        notes.append("Engine sequences per decode step (batching): " + ", ".join(parts) + ".")
    idle = [c for c in cells if c.telemetry.decode_idle_share is not None]
    if idle:  # per (target, concurrency) the repeat with the most idle time
        worst_idle: dict[tuple[str, int], CellRecord] = {}
        for c in idle:
            key = (c.target, c.concurrency)
            if key not in worst_idle or (c.telemetry.decode_idle_share or 0.0) > (
                worst_idle[key].telemetry.decode_idle_share or 0.0
            ):
                worst_idle[key] = c
        parts = [f"{t} c={conc}: {_idle_part(c)}" for (t, conc), c in sorted(worst_idle.items())]
        notes.append(
            "Engine decode stream idle between steps, share of its GPU time (share of steps "
            "the host launched late; share of the idle before steps that admitted, read and "
            "ended no request), worst repeat: " + ", ".join(parts) + "."
        )
        late = [
            (t, conc, c.telemetry.decode_late_host_ms)
            for (t, conc), c in sorted(worst_idle.items())
            if c.telemetry.decode_late_host_ms
        ]
        if late:
            parts = [f"{t} c={conc}: " + " / ".join(f"{ms.get(p, 0.0):.2f}" for p in HOST_PHASES)
                     for t, conc, ms in late]  # fmt: skip
            notes.append(f"Engine host ms before a late step ({' / '.join(HOST_PHASES)}), same "
                         "repeats: " + ", ".join(parts) + ".")  # fmt: skip
    for field, what in (("gc_ms_per_s", "Server"), ("engine_gc_ms_per_s", "Engine process")):
        gc_worst: dict[tuple[str, int], float] = {}
        for c in cells:
            ms = getattr(c.telemetry, field)
            if ms is not None:
                key = (c.target, c.concurrency)
                gc_worst[key] = max(gc_worst.get(key, 0.0), ms)
        if gc_worst:
            parts = [f"{t} c={conc}: {ms:.2f}" for (t, conc), ms in sorted(gc_worst.items())]
            notes.append(f"{what} garbage-collector pauses, ms per second of the cell (worst "
                         "repeat): " + ", ".join(parts) + ".")  # fmt: skip
    hits = [c for c in cells if c.telemetry.prefix_cache_hit_rate is not None]
    if hits:
        worst = max(hits, key=lambda c: c.telemetry.prefix_cache_hit_rate or 0.0)
        notes.append(
            f"Prefix cache hit rate up to {worst.telemetry.prefix_cache_hit_rate:.1%} "
            f"({worst.key().name()})."
        )
    return notes


def _idle_part(c: CellRecord) -> str:
    t = c.telemetry
    plain = "" if t.decode_idle_plain_share is None else f"; {t.decode_idle_plain_share:.0%}"
    return f"{t.decode_idle_share or 0.0:.1%} ({t.decode_starved_share or 0.0:.1%}{plain})"
