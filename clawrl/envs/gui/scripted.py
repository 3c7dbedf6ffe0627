"""A scripted agent for the GUI track: it follows a task's plan (clawrl/envs/gui/apps.py),
finding each element's id in the last page state by its role and name, as a model would read
it. Used by `clawrl bench env --env gui` and the tests; no model.

    reply = scripted_reply(step, state_text, index)   # an assistant message with one call
"""

from __future__ import annotations

import json
import re
from typing import Any

from clawrl.envs.gui.apps import Step

LINE = re.compile(r'^(?:[ ~+] )?\[(\d+)\] (\w+) ("(?:[^"\\]|\\.)*")')


def find_id(state: str, role: str, name: str) -> int | None:
    """The id of the element with this role and name in a page state (the last one listed
    when several are: a dialog comes after the page it covers)."""
    found = None
    for line in state.splitlines():
        m = LINE.match(line)
        if m and m.group(2) == role and json.loads(m.group(3)) == name:
            found = int(m.group(1))
    return found


def scripted_call(step: Step, state: str) -> tuple[str, dict[str, Any]]:
    """The tool call (name, arguments) that carries out `step` on the page `state`; an
    element not found is clicked as id 0 (the environment answers with an error)."""
    if step[0] == "done":
        return "done", {}
    if step[0] == "press":
        return "press", {"key": step[1]}
    element = find_id(state, step[1], step[2]) or 0
    if step[0] == "type":
        return "type", {"element_id": element, "text": step[3]}
    return "click", {"element_id": element}


def scripted_reply(step: Step, state: str, index: int = 0) -> dict[str, Any]:
    name, args = scripted_call(step, state)
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"c{index}", "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)}}]}
