"""Versioned weight folders: `weights/v{N:06d}/`, written once, completion marker last.

A version folder is a plain Hugging Face model directory (safetensors + config.json +
tokenizer files copied from the base model) that SGLang or `clawrl engine` loads with
`/update_weights_from_disk` — or, when the shared model learns as a LoRA adapter, a PEFT
adapter folder (adapter_config.json + adapter_model.safetensors) that the engine loads beside
the base with `/load_lora_adapter` (trainer/policy_adapter.py). It may also hold
`trainer_state/` (optimizer, RNG; see checkpoint.py), which engines ignore.

Atomicity: everything is written into a hidden temporary folder, the marker
`clawrl_complete.json` (listing every served file and its size) is written last, then the
folder is renamed to its final name. A folder without a valid marker is never published,
and an existing version folder is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

MARKER = "clawrl_complete.json"
# A version of a shared model that learns as a LoRA adapter is a PEFT folder instead
# (adapter_config.json + adapter_model.safetensors; trainer/policy_adapter.py).
ADAPTER_CONFIG = "adapter_config.json"
STATE_DIR = "trainer_state"
# Files copied from the base model so every version folder is self-contained.
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt",
                      "chat_template*", "added_tokens.json", "generation_config.json")


class CheckpointError(Exception):
    """A version folder is missing, incomplete or corrupt (message says which and why)."""


def version_dir(weights_dir: Path, version: int) -> Path:
    return weights_dir / f"v{version:06d}"


def parse_version_dir(path: Path) -> int | None:
    name = path.name
    if len(name) == 7 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_tokenizer_files(base_model_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for pattern in TOKENIZER_PATTERNS:
        for src in base_model_dir.glob(pattern):
            if src.is_file() and not (out_dir / src.name).exists():
                shutil.copy2(src, out_dir / src.name)
                copied.append(src.name)
    return copied


def write_version(
    weights_dir: Path,
    version: int,
    write_files: Callable[[Path], None],
    base_model_dir: Path,
    info: dict[str, object] | None = None,
) -> Path:
    """Create `weights_dir/v{version:06d}` atomically; `write_files(tmp)` writes the model.

    Raises CheckpointError if the version folder already exists (never overwrite).
    """
    final = version_dir(weights_dir, version)
    if final.exists():
        raise CheckpointError(f"{final} already exists; version folders are never overwritten")
    weights_dir.mkdir(parents=True, exist_ok=True)
    tmp = weights_dir / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_files(tmp)
        if not (tmp / ADAPTER_CONFIG).is_file():  # an adapter is loaded onto the base's
            copy_tokenizer_files(base_model_dir, tmp)
        served = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        if not ({"config.json", ADAPTER_CONFIG} & served.keys()) or \
                not any(n.endswith(".safetensors") for n in served):
            raise CheckpointError(f"export of v{version} wrote no config.json (or "
                                  f"{ADAPTER_CONFIG}) / safetensors")
        _fsync_tree(tmp)
        marker = {"version": version, "files": served, "created_at": time.time(), **(info or {})}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1))
        _fsync_tree(tmp)
        os.rename(tmp, final)
        dir_fd = os.open(weights_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def verify_version(path: Path) -> dict[str, object]:
    """Check a version folder is complete and loadable; return its marker. Raises
    CheckpointError naming the problem (missing folder, no marker, truncated file, …)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    marker_path = path / MARKER
    if not marker_path.is_file():
        raise CheckpointError(f"{path} has no completion marker {MARKER} (incomplete export?)")
    try:
        marker = json.loads(marker_path.read_text())
        files = dict(marker["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{marker_path} is unreadable: {exc}") from exc
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {name} has {f.stat().st_size} bytes, the marker says {size} (corrupt)")
    _check_safetensors(path, [n for n in files if n.endswith(".safetensors")])
    return dict(marker)


def _check_safetensors(path: Path, names: list[str]) -> None:
    from safetensors import safe_open

    for name in names:
        try:
            with safe_open(str(path / name), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises several types for a bad header
            raise CheckpointError(f"{path}: {name} is not a readable safetensors file: {exc}") \
                from exc


def list_version_dirs(weights_dir: Path) -> dict[int, Path]:
    """Every `v{N}` folder (complete or not), by version number."""
    if not weights_dir.is_dir():
        return {}
    found = {}
    for p in weights_dir.iterdir():
        n = parse_version_dir(p)
        if n is not None and p.is_dir():
            found[n] = p
    return dict(sorted(found.items()))


def remove_temp_dirs(weights_dir: Path) -> list[Path]:
    """Delete half-written `.tmp-v…` folders left by a crash during export."""
    removed = []
    if weights_dir.is_dir():
        for p in weights_dir.glob(".tmp-v*"):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
