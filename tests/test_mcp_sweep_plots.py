"""Issue 53, part 1: `run_sweep` through a real stdio MCP session (`gpurig mcp`, as Claude Code
runs it) writes its PNG plots where the CLI does, out_dir/plots, and says where (`plots_dir`).

The case reported: two live engine servers and one target that is down from the start, out_dir
given, wait true. Every plot the result lists must be a valid PNG under out_dir/plots.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from bench.sweep.models import SweepResult
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess, free_port
from tests.test_sweep_e2e import _png_ok

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("plots-ckpt")
    started = {}
    try:
        for name, seed in (("a", 0), ("b", 1)):
            make_checkpoint(root / name, preset="tiny", seed=seed)
            started[name] = (ServerProcess(root / name), root / name)
        yield started
    finally:
        for s, _ in started.values():
            s.stop()


async def _run(gpurig_bin: str, arguments: dict) -> SweepResult:
    params = StdioServerParameters(command=gpurig_bin, args=["mcp"], env=dict(os.environ))
    async with Client(params, read_timeout_seconds=600) as client:
        result = await client.call_tool("run_sweep", arguments)
        assert not result.is_error, result.content
        return SweepResult.model_validate(result.structured_content)


def test_stdio_run_sweep_writes_its_plots(engines, gpurig_bin: str, tmp_path: Path) -> None:
    out = tmp_path / "mcp-sweep"
    targets = [{"label": k, "base_url": s.base + "/v1", "model_dir": str(d)}
               for k, (s, d) in engines.items()]  # fmt: skip
    targets.append({"label": "down", "base_url": f"http://127.0.0.1:{free_port()}/v1"})
    arguments = {"targets": targets, "input_lens": [16], "output_len": 4,
                 "concurrency": [1, 2], "repeats": 1, "prompts_per_cell": 2,
                 "out_dir": str(out), "wait": True}  # fmt: skip
    result = asyncio.run(asyncio.wait_for(_run(gpurig_bin, arguments), timeout=600))
    assert result.state == "done" and result.out_dir == str(out.resolve())
    assert any(f.startswith("down: target down") for f in result.failures)
    assert result.plots_dir == str(out.resolve() / "plots") and result.plot_note is None
    assert len(result.plots) == 3
    for p in result.plots:
        assert Path(p).parent == out.resolve() / "plots"
        _png_ok(p)
    assert sorted(x.name for x in (out / "plots").glob("*.png")) == sorted(
        Path(p).name for p in result.plots
    )
    report = (out / "REPORT.md").read_text()
    assert all(f"(plots/{Path(p).name})" in report for p in result.plots)
