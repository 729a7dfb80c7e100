"""A real, empty virtual environment for tests (a plain module: `conftest` is ambiguous to import,
since tests/kernels has its own)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def make_venv(where: Path) -> Path:
    """A real, empty virtual environment (no pip: fast); returns its python."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60
    )
    python = where / "bin" / "python"
    assert python.exists()
    return python
