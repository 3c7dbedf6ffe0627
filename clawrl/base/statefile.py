"""Where a running `clawrl up` says what it serves, so admin commands find it from any folder.

`clawrl up` writes one small JSON file, readable by its user only (0600 from creation):

    $CLAWRL_STATE_FILE, else $XDG_STATE_HOME/clawrl/stack.json,
    else ~/.local/state/clawrl/stack.json

naming its pid (and the pid's start time, so a reused pid is not mistaken for it), state
dir, database URL, proxy and engine URLs and the engine's key. It is removed on a clean
stop; a file whose process is gone is stale and ignored. `clawrl users|keys|sql|versions`
read it (through `apply_to_env`) unless `CLAWRL_DATABASE__URL` is set.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any


def state_file() -> Path:
    explicit = os.environ.get("CLAWRL_STATE_FILE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "clawrl" / "stack.json"


def write_secret(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, from the moment it exists
    (never a window with default permissions); replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"  # alive, start time unknown (no /proc)
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def write_stack(info: dict[str, Any]) -> Path:
    """Record this process as the running stack."""
    path = state_file()
    record = {"pid": os.getpid(), "pid_start": _process_start(os.getpid()), **info}
    write_secret(path, json.dumps(record, indent=2) + "\n")
    return path


def remove_stack() -> None:
    """Remove the record if it is this process's (another stack may have replaced it)."""
    path = state_file()
    record = _read(path)
    if record is not None and record.get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def running_stack() -> dict[str, Any] | None:
    """The record of the running stack, or None (no file, unreadable, or stale)."""
    record = _read(state_file())
    if record is None or not isinstance(record.get("pid"), int):
        return None
    start = _process_start(record["pid"])
    if start is None or (start != "?" and start != record.get("pid_start")):
        return None  # the process is gone, or its pid now belongs to another process
    return record


# Record field -> the environment variable that hands it to a command's settings.
_ENV = {"database_url": "CLAWRL_DATABASE__URL", "state_dir": "CLAWRL_STATE_DIR",
        "engine_url": "CLAWRL_ENGINE__URL", "engine_api_key": "CLAWRL_ENGINE__API_KEY"}


def apply_to_env(environ: MutableMapping[str, str]) -> dict[str, Any] | None:
    """Point an admin command at the running stack: unless `CLAWRL_DATABASE__URL` is set
    (an explicit database wins, and then nothing of the stack's is used), copy the stack's
    database, state dir and engine into `environ` where not set. Returns the record used."""
    if environ.get("CLAWRL_DATABASE__URL"):
        return None
    record = running_stack()
    if record is None:
        return None
    for field, var in _ENV.items():
        value = record.get(field)
        if value and not environ.get(var):
            environ[var] = str(value)
    return record
