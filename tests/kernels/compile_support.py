"""Run a kernel test module as a script that compiles its kernel for GPU targets (Triton's own
ptxas, no GPU), outside the interpreter this directory's conftest turns on; its JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def compiled_rows(script: str, targets: list[int]) -> list[dict]:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script, *map(str, targets)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
