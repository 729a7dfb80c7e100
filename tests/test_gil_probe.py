"""lab/engine/gil_probe.py: per op, alone and beside a thread spinning in Python, for each
switch interval asked for; the interval is restored after."""

from __future__ import annotations

import sys

from lab.engine.gil_probe import probe


def test_probe_times_every_op_at_every_interval() -> None:
    before = sys.getswitchinterval()
    got = probe([0.002, 0.001], n_alone=20, n_busy=5)
    assert sys.getswitchinterval() == before
    rows = got["rows"]
    assert {r["switch_interval_ms"] for r in rows} == {2.0, 1.0}
    assert len({r["op"] for r in rows}) * 2 == len(rows)
    assert all(r["alone_us"] > 0 and r["beside_busy_thread_us"] > 0 for r in rows)
