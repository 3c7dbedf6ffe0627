"""The page as text for the model: one line per element of the walk (clawrl/envs/gui/walk.js),

    [3] switch "Dark mode" off @40,96,120,118
    [7] combobox "Language" = "English" collapsed @200,140,310,164

id, role, name, value (fields and dropdowns), states (on/off, expanded/collapsed, selected,
invalid, focused, disabled) and the on-screen box (left, top, right, bottom in CSS pixels of
the 800x600 viewport). After an action every line is marked against the page before it:
`  ` unchanged, `~ ` changed (its role, name, value or states; a box that only moved is no
change), `+ ` new, and the elements that went are listed last with `- `. `changes` view
leaves the unchanged lines out. A page longer than `max_lines` elements is cut there with a
count of what was left out; names and values are cut at 48 characters; elements outside
the viewport, and those a modal dialog covers, are only counted (scroll to see them, close
the dialog to reach them); covered elements keep their ids and lines, so closing a dialog
shows them unchanged rather than new.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TEXT_LIMIT = 48


def _quote(text: str) -> str:
    if len(text) > TEXT_LIMIT:
        text = text[: TEXT_LIMIT - 1] + "…"
    return json.dumps(text, ensure_ascii=False)


def describe(item: dict[str, Any]) -> str:
    """An element's line without its box: what a change is measured on."""
    line = f"[{item['id']}] {item['role']} {_quote(item['name'])}"
    if item.get("value") is not None:
        line += f" = {_quote(item['value'])}"
    if item.get("states"):
        line += " " + " ".join(item["states"])
    return line


@dataclass
class View:
    """What the last state showed, to mark the next one against."""
    lines: dict[int, str] = field(default_factory=dict)  # id -> describe()
    roles: dict[int, str] = field(default_factory=dict)
    covered: set[int] = field(default_factory=set)  # behind a modal dialog
    size: tuple[int, int] = (0, 0)


@dataclass
class Rendered:
    text: str
    view: View
    changed: int = 0
    new: int = 0
    gone: int = 0


def render(snap: dict[str, Any], before: View | None, mode: str = "full",
           max_lines: int = 40) -> Rendered:
    """The state's text; marked against `before` when there is one."""
    now = View(size=(snap["width"], snap["height"]))
    body: list[str] = []
    marks = {"changed": 0, "new": 0}
    for item in snap["items"]:
        i = item["id"]
        now.lines[i] = describe(item)
        now.roles[i] = item["role"]
        if item.get("covered"):  # remembered as last shown: uncovered, it is marked against that
            now.covered.add(i)
            now.lines[i] = before.lines.get(i, now.lines[i]) if before else now.lines[i]
            continue
        line = f"{now.lines[i]} @{','.join(map(str, item['box']))}"
        if before is None:
            body.append(line)
            continue
        mark = "  " if before.lines.get(i) == now.lines[i] else "+ " if i not in before.lines \
            else "~ "
        marks["changed" if mark == "~ " else "new"] += mark != "  "
        if mark != "  " or mode == "full":
            body.append(mark + line)
    gone = [f"- {line}" for i, line in before.lines.items() if i not in now.lines] \
        if before else []
    shown = (body + gone)[:max_lines]
    cut = len(body) + len(gone) - len(shown)
    head = f"page {_quote(snap['title'])} {snap['width']}x{snap['height']}"
    if snap["scroll"] != [0, 0]:
        head += f", scrolled to {snap['scroll'][0]},{snap['scroll'][1]}"
    if before is not None:
        head += (f"; {marks['changed']} changed, {marks['new']} new, {len(gone)} gone"
                 if marks["changed"] or marks["new"] or gone else "; nothing changed")
    tail = []
    if mode == "changes" and before is not None:
        unchanged = sum(1 for i in now.lines
                        if i not in now.covered and before.lines.get(i) == now.lines[i])
        if unchanged:
            tail.append(f"({unchanged} unchanged elements not shown)")
    if now.covered:
        tail.append(f"({len(now.covered)} elements behind the dialog)")
    if cut:
        tail.append(f"({cut} more elements not shown)")
    for n, where in ((snap["above"], "above"), (snap["below"], "below")):
        if n:
            tail.append(f"({n} more elements {where} the viewport: scroll to see them)")
    return Rendered("\n".join([head, *shown, *tail]), now, marks["changed"], marks["new"],
                    len(gone))
