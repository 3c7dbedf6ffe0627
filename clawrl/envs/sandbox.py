"""A sandboxed shell for one episode: a temporary directory, resource limits, no network.

    sandbox = Sandbox(Limits(cpu_s=5))
    sandbox.write("data.txt", "a\\nb\\n")
    result = await sandbox.run("wc -l data.txt")   # exit code, output (capped), timed out
    sandbox.close()                                 # kills what is left, removes the folder

Each command is `/bin/sh -c COMMAND` in the episode's folder, in a new session, with a minimal
environment (no proxies, HOME and TMPDIR in the folder) and `resource.setrlimit` limits set in
the child before exec: CPU seconds, address space, processes, file size, open files; a
wall-clock timeout kills the whole process group. Isolation, strongest first:

- run as root: every sandbox gets a uid of its own (no passwd entry, never used by another
  process) that owns its folder (mode 0700). The command runs as that uid, so the process limit
  counts only the sandbox's processes (root itself is exempt from RLIMIT_NPROC), it cannot
  read another episode's folder, and `close` kills every process of that uid, even ones that
  left the process group (setsid, daemons).
- network: `unshare -n` (a network namespace with only a downed loopback: every connection is
  refused, localhost included) when it works here, probed once; else, as a user, `unshare -c
  -n` (a user namespace). When neither works the command runs with the network and only its
  proxy variables removed; `network_isolated()` says which, and `clawrl env` prints it.
- disk: as root the folder is a tmpfs of `disk_mb` (mounted when the sandbox is made, unmounted
  when it closes): a command that writes past it gets "No space left on device", and the
  machine's own disk is never touched. Elsewhere the folder's size is measured after each
  command. Either way a command that leaves the folder full is flagged (`RunResult.disk_full`).
- not root: the command runs as the caller; the process limit counts the caller's processes
  too (it is set to those plus the limit), and leftovers outside the process group survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import pwd
import random
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

SHELL = "/bin/sh"
UID_RANGE = (200_000, 260_000)  # sandbox uids (root only): far above any system's users


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5            # CPU seconds per command (SIGXCPU, then SIGKILL)
    memory_mb: int = 512      # address space per process
    processes: int = 32       # processes of the sandbox at once (fork fails past it)
    file_mb: int = 1          # largest file a command may write (SIGXFSZ past it)
    open_files: int = 64
    timeout_s: float = 10.0   # wall clock per command; the process group is killed after it
    output_bytes: int = 4096  # output kept per command (the rest is read and dropped)
    disk_mb: int = 64         # the whole folder (a tmpfs of this size as root)


@dataclass(frozen=True)
class RunResult:
    exit_code: int  # the shell's exit status; -N when killed by signal N
    output: str     # stdout and stderr interleaved, at most `output_bytes` (UTF-8, replaced)
    truncated: bool
    timed_out: bool
    disk_full: bool = False  # the folder was at its disk limit when the command ended

    def describe(self) -> str:
        """The text a model reads back as the tool result."""
        return f"exit code {self.exit_code}\n{self.output}{self.notes()}"

    def notes(self) -> str:
        """What the limits did to the command, as lines to append to its output."""
        tail = "\n[output truncated]" if self.truncated else ""
        if self.timed_out:
            tail += "\n[killed: the command ran past its time limit]"
        if self.disk_full:
            tail += "\n[the sandbox's disk is full]"
        return tail


@functools.cache
def _unshare_prefix() -> tuple[str, ...] | None:
    """The command prefix that gives a child its own empty network namespace, or None."""
    if shutil.which("unshare") is None:
        return None
    # -p -f: a pid namespace whose first process is the shell; when it ends, the kernel
    # kills and reaps whatever it left (setsid, daemons, zombies counted against the process
    # limit). --kill-child: when unshare itself is killed (the timeout), so is the shell.
    ns = ("-n", "-p", "-f", "--kill-child", "-m", "--mount-proc")
    candidates = ([("unshare", *ns)] if os.geteuid() == 0
                  else [("unshare", "-c", *ns), ("unshare", "-r", *ns), ("unshare", "-r", "-n")])
    for prefix in candidates:
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok == 0:
            return prefix
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path: Path, size_mb: int, uid: int) -> bool:
    """Mount a tmpfs of `size_mb` on `path`, owned by `uid` (root only); False when the
    kernel refuses (no CAP_SYS_ADMIN, e.g. in an unprivileged container)."""
    options = f"size={size_mb}m,mode=0700,uid={uid},gid={uid}".encode()
    ms_nosuid, ms_nodev = 2, 4
    done: int = _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", ms_nosuid | ms_nodev,
                              options)
    return done == 0


def network_isolated() -> bool:
    """Whether sandboxed commands run without network (a namespace of their own)."""
    return _unshare_prefix() is not None


def _uid_in_use(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        pass
    return any(_uid_of(p) == uid for p in psutil.process_iter())


def _uid_of(proc: psutil.Process) -> int | None:
    try:
        return int(proc.uids().real)
    except psutil.Error:
        return None


def _own_processes() -> int:
    uid = os.getuid()
    return sum(1 for p in psutil.process_iter() if _uid_of(p) == uid)


class Sandbox:
    """One episode's folder and the commands run in it (see the module docstring)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.path = Path(tempfile.mkdtemp(prefix="clawrl-sandbox-"))
        self.uid: int | None = None
        if os.geteuid() == 0:
            rng = random.Random()
            for _ in range(100):
                uid = rng.randrange(*UID_RANGE)
                if not _uid_in_use(uid):
                    self.uid = uid
                    break
            else:
                self.close()
                raise RuntimeError("no free sandbox uid")
            os.chown(self.path, self.uid, self.uid)
        self.mounted = self.uid is not None and _mount_tmpfs(self.path, self.limits.disk_mb,
                                                             self.uid)
        self._real = os.path.realpath(self.path)
        self._closed = False

    # Files the environment sets up and reads back (as the parent: root when root).

    def write(self, name: str, text: str) -> None:
        """Create `name` (relative, folders made) owned by the sandbox's user."""
        path = self.inside(name)
        for parent in reversed(path.relative_to(self.path).parents[:-1]):
            folder = self.path / parent
            folder.mkdir(exist_ok=True)
            self._own(folder)
        if os.path.islink(path):
            raise ValueError(f"{name!r} is a link")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        self._own(path)

    def read(self, name: str, limit: int = 1 << 20) -> str | None:
        """The text of regular file `name`, or None when it is missing, a link, a folder,
        or larger than `limit` bytes: the sandbox's contents are the agent's, so a link to
        a file outside it is not followed by the verifier."""
        path = self.inside(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(limit).decode("utf-8", errors="replace")
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.inside(name))

    def inside(self, name: str) -> Path:
        """The path of `name` in the folder; ValueError for one that leaves it, by `..`, an
        absolute path, or a folder that is a link out (the agent's commands make links)."""
        path = self.path / name
        if ".." in Path(name).parts or Path(name).is_absolute() or not name.strip():
            raise ValueError(f"{name!r} is not a path inside the sandbox")
        parent = os.path.realpath(path.parent)
        if parent != self._real and not parent.startswith(self._real + os.sep):
            raise ValueError(f"{name!r} is not a path inside the sandbox")
        return path

    def disk_used(self) -> int:
        """Bytes the folder holds (the tmpfs's use as root; else the files' sizes)."""
        if self.mounted:
            st = os.statvfs(self.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        total = 0
        for folder, dirs, files in os.walk(self.path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def _own(self, path: Path) -> None:
        if self.uid is not None:
            os.chown(path, self.uid, self.uid, follow_symlinks=False)

    # Commands.

    def _command(self, command: str) -> list[str]:
        prefix = _unshare_prefix()
        if prefix is None:
            return [SHELL, "-c", command]
        if self.uid is not None:  # unshare drops to the uid after entering the namespace
            prefix = (*prefix, "-S", str(self.uid), "-G", str(self.uid))
        if "-p" not in prefix:
            return [*prefix, "--", SHELL, "-c", command]
        # The namespace's first process ignores signals it has no handler for (SIGXCPU,
        # SIGXFSZ): an outer shell takes that place and waits, the command runs under it.
        return [*prefix, "--", SHELL, "-c", f'{SHELL} -c "$1"; exit $?', "sh", command]

    def _preexec(self) -> Callable[[], None]:
        lim = self.limits
        nproc = lim.processes if self.uid is not None else _own_processes() + lim.processes
        drop_to = None if self.uid is None or _unshare_prefix() is not None else self.uid

        def preexec() -> None:  # in the child, before exec: no Python objects shared
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
            memory = lim.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            size = lim.file_mb << 20
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
            resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if drop_to is not None:  # root without unshare: drop privileges here
                os.setgroups([])
                os.setgid(drop_to)
                os.setuid(drop_to)

        return preexec

    def _environ(self) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.path),
                "TMPDIR": str(self.path), "LANG": "C.UTF-8", "PWD": str(self.path)}

    async def run(self, command: str) -> RunResult:
        """Run one shell command under the limits; its exit code and (capped) output."""
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        lim = self.limits
        proc = await asyncio.create_subprocess_exec(
            *self._command(command), cwd=self.path, env=self._environ(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            preexec_fn=self._preexec())
        assert proc.stdout is not None
        kept = bytearray()
        seen = 0

        async def drain() -> None:
            nonlocal seen
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                seen += len(chunk)
                if len(kept) < lim.output_bytes:
                    kept.extend(chunk[: lim.output_bytes - len(kept)])
            await proc.wait()

        timed_out = False
        try:
            await asyncio.wait_for(drain(), lim.timeout_s)
        except TimeoutError:
            timed_out = True
        finally:
            self._kill_group(proc.pid)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        code = proc.returncode
        # `unshare` reports a child killed by signal N as 128 + N, like a shell does.
        full = self.disk_used() > (lim.disk_mb << 20) - (256 << 10)
        return RunResult(-1 if code is None else code,
                         kept.decode("utf-8", errors="replace"), seen > len(kept), timed_out,
                         full)

    def _kill_group(self, pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def close(self) -> None:
        """Kill every process left behind and remove the folder (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.uid is not None:
            for _ in range(10):  # a process may fork while we kill: repeat until none is left
                left = [p for p in psutil.process_iter() if _uid_of(p) == self.uid]
                if not left:
                    break
                for p in left:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                psutil.wait_procs(left, timeout=1.0)
        if getattr(self, "mounted", False):
            mnt_detach = 2
            _libc().umount2(str(self.path).encode(), mnt_detach)
        shutil.rmtree(self.path, onerror=_make_writable)  # Python 3.11 (pyproject)


def _make_writable(func: Callable[..., object], path: str, exc: object) -> None:
    """rmtree's error handler, for a user sandbox whose agent removed its own write bits."""
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        func(path)
