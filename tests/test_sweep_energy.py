"""Energy per cell (issue 53, part 2): NVML's energy counter read at each cell's start and end,
reported as vLLM's benchmarks/lib/energy.py reports it (J, average W, J per output token),
beside the roofline share in REPORT.md and in results.json/csv. No GPU here: the NVML binding
is replaced by a stand-in that replays readings from tests/data/nvml_h100_energy.json (made-up
but plausible H100 numbers, as that file says), under a real sweep against the real engine
server; without it, the no-GPU path says why there is no energy.
"""

from __future__ import annotations

import csv
import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.sweep import run_sweep, telemetry
from bench.sweep.telemetry import NvmlSampler
from engine.checkpoint_maker import make_checkpoint
from tests.server_support import ServerProcess

FIXTURE = Path(__file__).parent / "data" / "nvml_h100_energy.json"


class ReplayNvml:
    """pynvml's functions the sweep calls, answering the fixture's readings in turn."""

    NVML_CLOCK_SM = 1

    def __init__(self, energy: list[int] | None = None, supported: bool = True) -> None:
        self.data = json.loads(FIXTURE.read_text())
        self.energy_reads = list(energy if energy is not None else self.data["energy_mj"])
        self.supported = supported
        self._power = itertools.cycle(self.data["power_mw"])
        self._util = itertools.cycle(self.data["util_gpu"])
        self._clock = itertools.cycle(self.data["sm_clock_mhz"])

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return ("gpu", index)

    def nvmlDeviceGetName(self, _h: Any) -> str:
        return self.data["name"]

    def nvmlDeviceGetMaxClockInfo(self, _h: Any, _kind: int) -> int:
        return self.data["max_sm_clock_mhz"]

    def nvmlDeviceGetPowerManagementLimit(self, _h: Any) -> int:
        return self.data["power_limit_mw"]

    def nvmlDeviceGetUtilizationRates(self, _h: Any) -> Any:
        return SimpleNamespace(gpu=next(self._util))

    def nvmlDeviceGetMemoryInfo(self, _h: Any) -> Any:
        return SimpleNamespace(used=self.data["memory_used_bytes"])

    def nvmlDeviceGetClockInfo(self, _h: Any, _kind: int) -> int:
        return next(self._clock)

    def nvmlDeviceGetPowerUsage(self, _h: Any) -> int:
        return next(self._power)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, _h: Any) -> int:
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, _h: Any) -> int:
        if not self.supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # a pre-Volta card
        return self.energy_reads.pop(0)


def _sample(nvml: ReplayNvml, monkeypatch: pytest.MonkeyPatch) -> NvmlSampler:
    monkeypatch.setattr(telemetry, "load_nvml", lambda: nvml)
    sampler = NvmlSampler(0, interval_s=0.01)
    sampler.start()
    time.sleep(0.2)
    gpu, missing = sampler.stop()
    assert missing is None and gpu is not None and gpu.name == "NVIDIA H100 80GB HBM3"
    return sampler


def test_the_counter_read_at_both_ends_gives_joules_and_power(monkeypatch) -> None:
    sampler = _sample(ReplayNvml(), monkeypatch)
    e = sampler.energy
    assert e is not None and e.missing is None and e.gpu_index == 0
    assert e.energy_j == pytest.approx((8114801337 - 8114250113) / 1000)  # 551.224 J
    assert e.duration_s and e.avg_power_w == pytest.approx(e.energy_j / e.duration_s, rel=1e-2)


def test_a_counter_that_went_back_or_does_not_exist_gives_no_energy(monkeypatch) -> None:
    back = _sample(ReplayNvml(energy=[9000, 8000]), monkeypatch).energy
    assert back is not None and back.energy_j is None
    assert (
        back.missing == "no energy: the GPU's energy counter went backwards (reset) during the cell"
    )
    old = _sample(ReplayNvml(supported=False), monkeypatch).energy
    assert old is not None and old.missing.startswith("no energy: this GPU has no energy counter")
    assert "Volta" in old.missing


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("energy-ckpt") / "tiny"
    make_checkpoint(path, preset="tiny", seed=0)
    proc = ServerProcess(path)
    yield proc
    proc.stop()


ARGS = {"input_lens": [16], "output_len": 8, "concurrency": [1, 2], "repeats": 1,
        "prompts_per_cell": 3, "gate": False}  # fmt: skip


def test_a_sweep_reports_joules_per_token_beside_the_roofline(server, tmp_path, monkeypatch):
    nvml = ReplayNvml()
    monkeypatch.setattr(telemetry, "load_nvml", lambda: nvml)
    result = run_sweep([{"label": "e", "base_url": server.base + "/v1"}],
                       out_dir=str(tmp_path / "s"), **ARGS)  # fmt: skip
    cells = json.loads(Path(result.results_json).read_text())["cells"]
    assert len(cells) == 2 and len(nvml.energy_reads) == 8 - 4  # two reads per cell
    for c, (e0, e1) in zip(
        cells, [(8114250113, 8114801337), (8115202114, 8115889021)], strict=True
    ):
        energy = c["telemetry"]["energy"]
        assert energy["energy_j"] == pytest.approx((e1 - e0) / 1000)
        assert c["output_tokens"] == 3 * 8
        assert energy["j_per_output_token"] == pytest.approx(energy["energy_j"] / 24, rel=1e-4)
        assert energy["avg_power_w"] > 0
    report = Path(result.report).read_text()
    section = report.split("## Energy per token (beside the roofline share)")[1].split("\n## ")[0]
    assert "e J/token" in section and "e roofline %" in section
    assert f"{cells[0]['telemetry']['energy']['j_per_output_token']:.4f}" in section
    text = Path(result.results_csv).read_text().splitlines()
    rows = sorted(csv.DictReader(text), key=lambda r: r["concurrency"])
    got = [(float(r["j_per_output_token"]), float(r["avg_power_w"])) for r in rows]
    want = [(c["telemetry"]["energy"]["j_per_output_token"], c["telemetry"]["energy"]["avg_power_w"])
            for c in sorted(cells, key=lambda c: c["concurrency"])]  # fmt: skip
    assert got == want


def test_without_a_gpu_the_report_says_why_there_is_no_energy(server, tmp_path) -> None:
    result = run_sweep([{"label": "e", "base_url": server.base + "/v1"}],
                       out_dir=str(tmp_path / "s"), **ARGS)  # fmt: skip
    cells = json.loads(Path(result.results_json).read_text())["cells"]
    missing = cells[0]["telemetry"]["energy"]["missing"]
    assert missing.startswith("no energy: ") and cells[0]["telemetry"]["energy"]["energy_j"] is None
    report = Path(result.report).read_text()
    assert "## Energy per token (beside the roofline share)" in report and missing in report
