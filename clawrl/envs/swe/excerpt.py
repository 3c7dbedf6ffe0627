"""`read_file(path, name)`: one definition's lines out of a Python module — a function, a
class, a method (`Store.add`, or `add` when one class has it) or a module constant — exactly
as they stand in the file, so that an agent can copy them into `replace_in_file`'s `old`.

A module is ~2 KB; one function is a few hundred bytes. A model with a short context (the SWE
track's tiny coding model, clawrl/swemodel/) reads the function a failing test names instead
of the whole file.
"""

from __future__ import annotations

import ast

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign


def _names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _definitions(tree: ast.Module) -> dict[str, list[ast.stmt]]:
    """Every name a reader may ask for -> the statements it may mean (a method by its bare
    name too, so `add` finds `Store.add`; two classes' `add` make it ambiguous)."""
    found: dict[str, list[ast.stmt]] = {}
    for node in tree.body:
        for name in _names(node):
            found.setdefault(name, []).append(node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                for name in _names(item):
                    found.setdefault(f"{node.name}.{name}", []).append(item)
                    found.setdefault(name, []).append(item)
    return found


def definition(text: str, path: str, name: str) -> str:
    """The lines of definition `name` in module `text` (decorators included), or ValueError
    with what to ask for instead."""
    if not path.endswith(".py"):
        raise ValueError(f"name only applies to Python files; read {path} without it")
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"{path} does not parse (line {exc.lineno}): read it without "
                         "name") from exc
    found = _definitions(tree)
    nodes = found.get(name.strip())
    if not nodes:
        raise ValueError(f"no function, class or constant {name!r} in {path} (its names: "
                         f"{', '.join(n for n in found if '.' not in n)})")
    if len(nodes) > 1:
        raise ValueError(f"{name!r} names {len(nodes)} definitions in {path}; say which, "
                         "e.g. Class.method")
    node = nodes[0]
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines(keepends=True)
    return "".join(lines[first - 1:node.end_lineno])
