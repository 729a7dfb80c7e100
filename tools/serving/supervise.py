"""The server's supervisor: runs the server and writes down how it ended.

Started as a script (stdlib only, no gpurig import: it must start instantly and under any
interpreter) in its own session, so it leads the process group that stop signals. It ignores
SIGTERM/SIGINT/SIGHUP itself (the signal reaches the server through the group) and stays to
write EXIT_FILE: {"returncode", "signal", "server_pid", "ended_at"}. Without it a server whose
starter has exited dies unobserved: nobody could tell an OOM kill (SIGKILL) from a clean exit.

Usage: python supervise.py EXIT_FILE -- COMMAND...
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from datetime import UTC, datetime


def _ignore(_signum, _frame):
    """A handler, not SIG_IGN: handlers are reset on exec, so the server keeps default signals."""


def _write(path, data):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".exit.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv):
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: supervise.py EXIT_FILE -- COMMAND...\n")
        return 2
    exit_file, command = argv[0], argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as exc:
        sys.stderr.write(f"gpurig supervisor: cannot start {command[0]}: {exc}\n")
        _write(
            exit_file,
            {
                "returncode": 127,
                "signal": None,
                "server_pid": None,
                "error": str(exc),
                "ended_at": _now(),
            },
        )
        return 127
    rc = child.wait()
    name = None
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
    _write(
        exit_file, {"returncode": rc, "signal": name, "server_pid": child.pid, "ended_at": _now()}
    )
    return rc if rc >= 0 else 128 - rc


def _now():
    return datetime.now(UTC).isoformat(timespec="seconds")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
