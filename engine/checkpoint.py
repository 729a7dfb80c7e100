"""Safetensors checkpoint I/O: read tensors by their text-model name, write sharded files atomically.

Reading: one `model.safetensors`, or shards listed in `model.safetensors.index.json`. Text weights
sit under `model.language_model.` (a Gemma4ForConditionalGeneration save) or `model.` (a
Gemma4ForCausalLM save); callers ask for names relative to the text model ("layers.0.mlp.up_proj")
and never see the prefix. Vision / audio towers are ignored. A linear is returned as stored:
`weight_packed` + `weight_scale` (+ `weight_shape`) gives a `PackedLinear` that stays packed on
the device; a plain `weight` gives a `PlainLinear`.

Writing: `ShardWriter` takes tensors one at a time and flushes a shard when it reaches a size
bound, so a 4.6 B-parameter checkpoint can be written from a generator without holding it all in
memory. Everything goes to a temporary sibling directory that is renamed onto the target at the
end: a failed write leaves nothing half-made.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import CheckpointError
from engine.packed import Linear, PackedLinear, PlainLinear

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TEXT_PREFIXES = ("model.language_model.", "model.")
_OTHER_TOWERS = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


class CheckpointReader:
    """Lazy access to a checkpoint's text-model tensors, by name relative to the text model."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self._where: dict[str, tuple[Path, str]] = {}  # relative name -> (file, stored key)
        self._handles: dict[Path, object] = {}
        for file, keys in self._files_and_keys().items():
            for key in keys:
                rel = _relative_name(key)
                if rel is not None:
                    self._where[rel] = (file, key)
        if not self._where:
            raise CheckpointError(
                f"no Gemma 4 text weights (keys under 'model.language_model.' or 'model.') in {self.model_dir}",
                "point at a Gemma 4 checkpoint directory",
            )

    def _files_and_keys(self) -> dict[Path, list[str]]:
        index = self.model_dir / INDEX_NAME
        single = self.model_dir / SINGLE_NAME
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(
                    f"{index} is not a safetensors index: {exc}", "restore it"
                ) from exc
            files: dict[Path, list[str]] = {}
            for key, shard in weight_map.items():
                files.setdefault(self.model_dir / shard, []).append(key)
            missing = sorted(p.name for p in files if not p.is_file())
            if missing:
                raise CheckpointError(
                    f"{len(missing)} shard(s) named in {INDEX_NAME} are missing: {', '.join(missing[:5])}",
                    "download or copy the missing shard files into the checkpoint directory",
                )
            return files
        if single.is_file():
            return {single: list(self._open(single).keys())}
        raise CheckpointError(
            f"{self.model_dir} holds neither {SINGLE_NAME} nor {INDEX_NAME}",
            "point at a safetensors checkpoint directory",
        )

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(
                    f"{file} is not a readable safetensors file: {exc}", "restore it"
                ) from exc
            self._handles[file] = handle
        return handle

    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor by relative name, copied to `device` as stored (no dtype change)."""
        if name not in self._where:
            raise CheckpointError(
                f"the checkpoint has no tensor {name!r}",
                "the checkpoint does not match its config.json; rebuild or re-download it",
            )
        file, key = self._where[name]
        try:
            t = self._open(file).get_tensor(key)
        except Exception as exc:  # safetensors' own error types: a key the index misplaces
            raise CheckpointError(
                f"{file.name} has no readable tensor {key!r}: {exc}",
                "the checkpoint's index and shards disagree; re-download or rebuild it",
            ) from exc
        return t.to(device) if str(device) != "cpu" else t

    def linear(self, name: str, device: torch.device | str = "cpu", group_size: int = 32) -> Linear:
        """The linear `name` as stored: packed 4-bit (`weight_packed`) or plain (`weight`)."""
        if self.has(f"{name}.weight_packed"):
            return self._packed(name, device, group_size)
        if self.has(f"{name}.weight"):
            return PlainLinear(self.tensor(f"{name}.weight", device))
        raise CheckpointError(
            f"the checkpoint has neither {name}.weight_packed nor {name}.weight",
            "the checkpoint does not match its config.json; rebuild or re-download it",
        )

    def _packed(self, name: str, device: torch.device | str, group_size: int) -> PackedLinear:
        packed = self.tensor(f"{name}.weight_packed", device)
        scales = self.tensor(f"{name}.weight_scale", device)
        if self.has(f"{name}.weight_shape"):
            n, k = (int(v) for v in self.tensor(f"{name}.weight_shape").tolist())
        else:
            n, k = int(packed.shape[0]), int(packed.shape[1]) * 8
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, (k + 7) // 8):
            raise CheckpointError(
                f"{name}.weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 {(n, (k + 7) // 8)}",
                "the checkpoint is not compressed-tensors pack-quantized W4A16; requantize it",
            )
        if scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
            raise CheckpointError(
                f"{name}.weight_scale has shape {tuple(scales.shape)} for a weight of {(n, k)}",
                "the checkpoint is damaged or uses another quantization layout; requantize it",
            )
        actual_group = k // int(scales.shape[1])
        if group_size and actual_group != group_size:
            raise CheckpointError(
                f"{name} has groups of {actual_group}, config.json declares {group_size}",
                "the checkpoint is damaged; requantize it",
            )
        if k % 8:
            raise CheckpointError(
                f"{name} has input width {k}, not a multiple of 8", "requantize it"
            )
        return PackedLinear(packed, scales, out_features=n, in_features=k, group_size=actual_group)

    def close(self) -> None:
        self._handles.clear()


def _relative_name(key: str) -> str | None:
    if key.startswith(_OTHER_TOWERS):
        return None
    if key == "lm_head.weight" or key.startswith("lm_head."):
        return key
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


# ---------------------------------------------------------------------------------------------
# writing


class ShardWriter:
    """Collect tensors and write them as safetensors shards of at most `max_shard_bytes`.

    Use as a context manager around an output directory: files go to a temporary sibling that
    replaces `out_dir` only when the block ends without an error.
    """

    def __init__(
        self, out_dir: Path, max_shard_bytes: int = 2 << 30, prefix: str = "model."
    ) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self._total_bytes = 0
        self.tmp_dir: Path | None = None

    def __enter__(self) -> ShardWriter:
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            what = "is not empty" if self.out_dir.is_dir() else "is a file"
            raise CheckpointError(
                f"{self.out_dir} already exists and {what}",
                "choose a new directory, or remove the old one first",
            )
        try:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            self.tmp_dir = Path(
                tempfile.mkdtemp(prefix=f".{self.out_dir.name}.", dir=self.out_dir.parent)
            )
            self.tmp_dir.chmod(
                0o777 & ~_umask()
            )  # mkdtemp makes it private; the result should not be
        except OSError as exc:
            raise CheckpointError(
                f"cannot create {self.out_dir}: {exc.strerror or exc}",
                "choose a directory you can write to",
            ) from exc
        return self

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor under `prefix + name` (name relative to the text model)."""
        self.add_raw(name if name.startswith("lm_head") else self.prefix + name, tensor)

    def add_raw(self, key: str, tensor: torch.Tensor) -> None:
        """Queue one tensor under its full stored key."""
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[key] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size

    def add_all(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def write_file(self, name: str, text: str) -> None:
        """A small text file (config, tokenizer, ...) written beside the shards."""
        assert self.tmp_dir is not None
        (self.tmp_dir / name).write_text(text)

    def copy_file(self, src: Path, name: str) -> None:
        assert self.tmp_dir is not None
        shutil.copyfile(src, self.tmp_dir / name)

    def _flush(self) -> None:
        assert self.tmp_dir is not None
        if not self._pending:
            return
        part = f"part-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.tmp_dir / part), metadata={"format": "pt"})
        self._shards.append((part, list(self._pending)))
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def _finish(self) -> None:
        assert self.tmp_dir is not None
        self._flush()
        if len(self._shards) == 1:
            os.replace(self.tmp_dir / self._shards[0][0], self.tmp_dir / SINGLE_NAME)
        else:
            total = len(self._shards)
            weight_map: dict[str, str] = {}
            for i, (part, keys) in enumerate(self._shards):
                final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
                os.replace(self.tmp_dir / part, self.tmp_dir / final)
                weight_map.update({k: final for k in keys})
            index = {
                "metadata": {"total_size": self._total_bytes},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (self.tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for f in self.tmp_dir.iterdir():
            f.chmod(0o666 & ~_umask())
            _fsync(f)
        if self.out_dir.exists():
            self.out_dir.rmdir()  # empty (checked on entry)
        os.replace(self.tmp_dir, self.out_dir)
        _fsync(self.out_dir.parent)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._finish()
        except OSError as err:
            exc = err
        finally:
            if self.tmp_dir is not None and self.tmp_dir.exists():
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
        if isinstance(exc, OSError):  # disk full, permissions: say so, not a traceback
            raise CheckpointError(
                f"writing {self.out_dir} failed: {exc.strerror or exc}; nothing was written",
                "free disk space or choose a directory you can write to, then run it again",
            ) from exc


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
