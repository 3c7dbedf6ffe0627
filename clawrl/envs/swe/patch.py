"""Unified diffs as an agent writes them, applied to text: the SWE track's `apply_patch`.

    changes = apply_patch(diff, read)   # {path: new text}, or PatchError with a clear reason

`read(path)` gives a file's current text (None when there is none). Hunk headers' line counts
are not trusted (models miscount them, as `git apply --recount` does not trust them either):
a hunk is its lines, read until the next hunk or file. Each hunk's context and removed lines
must match the file (trailing blanks ignored) at its stated line or, failing that, at the
nearest place after the previous hunk. All or nothing: nothing is written unless every hunk of
every file applies. `--- /dev/null` creates a file; deleting files is not supported.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """The patch cannot be read or does not apply: the message says why, in one line."""


@dataclass
class FilePatch:
    old: str  # the path in `---` (None-like "/dev/null" for a new file)
    new: str
    hunks: list[tuple[int, list[str]]] = field(default_factory=list)  # (old start, lines)


def _path(header: str) -> str:
    name = header[4:].split("\t")[0].strip()
    if name != "/dev/null" and name[:2] in ("a/", "b/"):
        name = name[2:]
    return name


def parse_patch(text: str) -> list[FilePatch]:
    lines = text.splitlines()
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
                raise PatchError(f"line {i + 1}: a '--- ' line must be followed by '+++ '")
            patches.append(FilePatch(_path(line), _path(lines[i + 1])))
            i += 2
            continue
        match = HUNK.match(line)
        if match:
            if not patches:
                raise PatchError(f"line {i + 1}: a hunk before any '--- a/FILE' '+++ b/FILE'")
            body: list[str] = []
            i += 1
            while i < len(lines) and not HUNK.match(lines[i]) and not lines[i].startswith(
                    "--- "):
                text_line = lines[i]
                if text_line.startswith("\\"):  # "\ No newline at end of file"
                    pass
                elif text_line == "" or text_line[0] in " +-":
                    body.append(text_line or " ")
                else:
                    raise PatchError(f"line {i + 1}: a hunk line must start with ' ', '+' or "
                                     f"'-': {text_line[:60]!r}")
                i += 1
            patches[-1].hunks.append((int(match.group(1)), body))
            continue
        i += 1  # text outside a file's hunks (a `diff --git` line, a comment) is skipped
    if not patches or not any(p.hunks for p in patches):
        raise PatchError("no hunks found: write a unified diff (--- a/FILE, +++ b/FILE, "
                         "@@ -LINE,COUNT +LINE,COUNT @@, then ' ', '-', '+' lines)")
    return patches


def _find(lines: list[str], old: list[str], want: int, start: int) -> int | None:
    """Where `old` matches in `lines`: at `want` if it does there, else the nearest match at
    or after `start`."""
    def at(pos: int) -> bool:
        return all(lines[pos + k].rstrip() == old[k].rstrip() for k in range(len(old)))

    last = len(lines) - len(old)
    if start <= want <= last and at(want):
        return want
    found = [pos for pos in range(start, last + 1) if at(pos)]
    return min(found, key=lambda pos: abs(pos - want)) if found else None


def _apply_file(patch: FilePatch, text: str, path: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    cursor = 0
    for number, (start, body) in enumerate(patch.hunks, 1):
        old = [b[1:] for b in body if b[0] in " -"]
        new = [b[1:] for b in body if b[0] in " +"]
        if not old:  # pure insertion: after line `start`
            pos: int | None = max(cursor, min(start, len(lines)))
        else:
            pos = _find(lines, old, start - 1, cursor)
        if pos is None:
            first = next((o for o in old if o.strip()), old[0])
            raise PatchError(f"hunk {number} of {path} does not apply: its context and removed "
                             f"lines (from {first.strip()!r}) are not in the file as written; "
                             "read_file shows its current text")
        out += lines[cursor:pos] + new
        cursor = pos + len(old)
    out += lines[cursor:]
    return "\n".join(out) + ("\n" if out else "")


def apply_patch(text: str, read: Callable[[str], str | None]) -> dict[str, str]:
    """The new text of every file the diff changes (see the module docstring)."""
    changes: dict[str, str] = {}
    for patch in parse_patch(text):
        if patch.new == "/dev/null":
            raise PatchError(f"deleting {patch.old} is not supported")
        path = patch.new
        if patch.old == "/dev/null":
            if read(path) is not None or path in changes:
                raise PatchError(f"{path} already exists; patch it instead of creating it")
            current = ""
        else:
            found = changes.get(path, read(path))
            if found is None:
                raise PatchError(f"no file named {path!r} (list_files shows the files)")
            current = found
        changes[path] = _apply_file(patch, current, path)
    return changes
