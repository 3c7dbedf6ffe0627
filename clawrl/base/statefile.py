"""Where a running `clawrl up` says what it serves, so admin commands find it from any folder.

`clawrl up` writes one small JSON file twice, readable by its user only (0600 from
creation): in its state dir (`<state-dir>/stack.json`) and as the user's "last started"
stack:

    $CLAWRL_STATE_FILE, else $XDG_STATE_HOME/clawrl/stack.json,
    else ~/.local/state/clawrl/stack.json

naming its pid (and the pid's start time, so a reused pid is not mistaken for it), state
dir, database URL, proxy and engine URLs and the engine's key. Both are removed on a clean
stop; a file whose process is gone is stale and ignored.

`clawrl users|keys|sql|versions|db` pick the stack they act on (`choose_stack`), first match
wins, so a delete or a rollback never lands on another stack than the one meant:

1. `CLAWRL_DATABASE__URL`: that database, nothing of any stack's;
2. an explicit state dir (`--state-dir`, `CLAWRL_STATE_DIR`): the stack running there, else
   that dir's own embedded database (never the last started stack);
3. the current folder's state dir (`./.clawrl`, as `clawrl up` would use from here), when a
   stack runs there or its embedded database exists;
4. the last started stack (the user's file above).

When the stack chosen is not the last started one, the command says which it acts on.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
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


STACK_FILE = "stack.json"  # a state dir's own record of the stack running on it


def write_stack(info: dict[str, Any]) -> Path:
    """Record this process as the running stack: in its state dir (`info["state_dir"]`)
    and as the user's last started stack. Returns the latter's path."""
    path = state_file()
    record = {"pid": os.getpid(), "pid_start": _process_start(os.getpid()), **info}
    text = json.dumps(record, indent=2) + "\n"
    if info.get("state_dir"):
        write_secret(Path(info["state_dir"]) / STACK_FILE, text)
    write_secret(path, text)
    return path


def remove_stack(state_dir: Path | None = None) -> None:
    """Remove the records that are this process's (another stack may have replaced the
    user's file): the user's file and the one in `state_dir` (or the dir it names)."""
    path = state_file()
    record = _read(path)
    paths = [path]
    named = state_dir or (record or {}).get("state_dir")
    if named:
        paths.append(Path(named) / STACK_FILE)
    for where in paths:
        mine = _read(where)
        if mine is not None and mine.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                where.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _live(path: Path) -> dict[str, Any] | None:
    """The record at `path` while its process runs, else None (none, unreadable, stale)."""
    record = _read(path)
    if record is None or not isinstance(record.get("pid"), int):
        return None
    start = _process_start(record["pid"])
    if start is None or (start != "?" and start != record.get("pid_start")):
        return None  # the process is gone, or its pid now belongs to another process
    return record


def running_stack() -> dict[str, Any] | None:
    """The record of the last started stack while it runs, or None."""
    return _live(state_file())


def stack_in(state_dir: Path) -> dict[str, Any] | None:
    """The record of the stack running on `state_dir`, or None."""
    record = _live(state_dir / STACK_FILE)
    if record is not None:
        return record
    last = running_stack()  # a stack that wrote only the user's file names its dir there
    if last is not None and _same_dir(last.get("state_dir"), state_dir):
        return last
    return None


def _same_dir(a: object, b: Path) -> bool:
    if not a:
        return False
    try:
        return Path(str(a)).resolve() == b.resolve()
    except OSError:
        return False


@dataclass(frozen=True)
class StackChoice:
    """The stack an admin command acts on and why (`choose_stack`)."""

    record: dict[str, Any] | None  # the running stack used, None: none (see `source`)
    state_dir: Path | None  # the state dir acted on, when known
    # database_url | state_dir (explicit) | folder (./.clawrl) | last_started | none
    source: str
    note: str | None = None  # a line for the user when another stack is not acted on


def choose_stack(environ: Mapping[str, str], cwd: Path | None = None) -> StackChoice:
    """Which stack an admin command acts on, by the precedence in this module's docstring."""
    last = running_stack()
    last_dir = str(last.get("state_dir") or "?") if last is not None else None
    if environ.get("CLAWRL_DATABASE__URL"):
        return StackChoice(None, None, "database_url")
    here = (cwd or Path.cwd())
    explicit = environ.get("CLAWRL_STATE_DIR")
    if explicit:
        state_dir, source = (here / Path(explicit).expanduser()).resolve(), "state_dir"
    else:
        state_dir, source = (here / ".clawrl").resolve(), "folder"
        if stack_in(state_dir) is None and not (state_dir / "pg" / "PG_VERSION").is_file():
            if last is None:
                return StackChoice(None, None, "none")
            return StackChoice(last, Path(last_dir) if last_dir and last_dir != "?" else None,
                               "last_started")
    record = stack_in(state_dir)
    note = None
    if last is not None and not _same_dir(last_dir, state_dir):
        how = ("the state dir given" if source == "state_dir"
               else "the state dir of this folder")
        note = (f"acting on the stack in {state_dir} ({how}; "
                f"{'running' if record else 'not running'}), not the last started one in "
                f"{last_dir}; pass --state-dir DIR to choose")
    return StackChoice(record, state_dir, source, note)


# Record field -> the environment variable that hands it to a command's settings.
_ENV = {"database_url": "CLAWRL_DATABASE__URL", "state_dir": "CLAWRL_STATE_DIR",
        "engine_url": "CLAWRL_ENGINE__URL", "engine_api_key": "CLAWRL_ENGINE__API_KEY"}


def apply_to_env(environ: MutableMapping[str, str], cwd: Path | None = None) -> StackChoice:
    """Point an admin command at its stack (`choose_stack`): copy the chosen stack's
    database, state dir and engine into `environ` where not set; with no running stack
    chosen but a state dir, set that state dir (its embedded database is then used)."""
    choice = choose_stack(environ, cwd)
    if choice.record is not None:
        for field, var in _ENV.items():
            value = choice.record.get(field)
            if value and not environ.get(var):
                environ[var] = str(value)
    elif choice.state_dir is not None and not environ.get("CLAWRL_STATE_DIR"):
        environ["CLAWRL_STATE_DIR"] = str(choice.state_dir)
    return choice
