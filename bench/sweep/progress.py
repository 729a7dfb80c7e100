"""Small pieces every sweep command line shares, kept below the front doors so that bench
scripts (lab/sweep_e2b.py) and the CLI (mcp_server/cli_sweep.py) both use them: the
comma-separated number lists of argparse, and the progress bar on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

BAR = 30


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {what}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def int_list(text: str) -> list[int]:
    """An argparse type: '512,4096' -> [512, 4096], with a usage error for anything else."""
    return _numbers(text, int, "integers")


def float_list(text: str) -> list[float]:
    """An argparse type: '2,4.5' -> [2.0, 4.5], with a usage error for anything else."""
    return _numbers(text, float, "numbers")


class ProgressBar:
    """One line on stderr, redrawn in place on a terminal, else a line every few seconds."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.first: tuple[float, int] | None = None  # (time, done) at the first request
        self.last = 0.0

    def __call__(self, done: int, total: int, message: str) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last < 5 and done < total:
            return
        self.last = now
        share = done / total if total else 1.0
        fill = int(share * BAR)
        eta = ""
        if self.first is None and done > 0:
            self.first = (now, done)  # server start-up and the first request are not a rate
        elif self.first is not None and self.first[1] < done < total:
            t1, d1 = self.first
            left = (now - t1) / (done - d1) * (total - done)
            eta = f" ETA {int(left) // 60}:{int(left) % 60:02d}"
        line = f"[{'#' * fill}{'.' * (BAR - fill)}] {done}/{total} requests{eta}  {message}"
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            if done >= total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
