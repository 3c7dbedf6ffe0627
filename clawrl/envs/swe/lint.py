"""A small static check of Python source, the SWE track's `run_linter` (pure Python: the
project adds no linter dependency, and a syntax tree is all these checks need).

Codes, as pyflakes/pycodestyle name them:

- E999 syntax error (nothing else is checked in that file);
- F401 an import never used;
- F821 a name read that nothing in the file binds and is not a builtin (a typo);
- F841 a local variable assigned and never read;
- E711 a comparison to None with == or != (use `is`).

Deliberately loose (a name bound anywhere in the file counts as bound everywhere) so that it
never reports correct template code: what it reports is new, and most often the agent's.
"""

from __future__ import annotations

import ast
import builtins

BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}


def _bound(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            names.update(node.names)
    return names


def _loaded(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def lint_source(path: str, text: str) -> list[str]:
    """The problems of one file, `path:line:col: CODE message`, in line order."""
    try:
        tree = ast.parse(text, path)
    except SyntaxError as exc:
        return [f"{path}:{exc.lineno}:{exc.offset}: E999 SyntaxError: {exc.msg}"]
    problems: list[tuple[int, int, str]] = []
    loaded = _loaded(tree)
    exported = {e.value for n in tree.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
                for e in ast.walk(n.value) if isinstance(e, ast.Constant)}
    for stmt in tree.body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            for alias in stmt.names:
                name = (alias.asname or alias.name).split(".")[0]
                if name not in loaded and name not in exported and name != "*":
                    problems.append((stmt.lineno, stmt.col_offset + 1,
                                     f"F401 '{alias.name}' imported but unused"))
    bound = _bound(tree) | BUILTINS
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
            problems.append((node.lineno, node.col_offset + 1,
                             f"F821 undefined name '{node.id}'"))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            used = _loaded(node)
            declared = {n for s in ast.walk(node) if isinstance(s, ast.Global | ast.Nonlocal)
                        for n in s.names}
            for inner in ast.walk(node):
                if isinstance(inner, ast.Assign):
                    for target in inner.targets:
                        if (isinstance(target, ast.Name) and target.id not in used
                                and target.id not in declared and target.id != "_"):
                            problems.append((target.lineno, target.col_offset + 1,
                                             f"F841 local variable '{target.id}' is assigned "
                                             "to but never used"))
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=False):
                if (isinstance(op, ast.Eq | ast.NotEq) and isinstance(right, ast.Constant)
                        and right.value is None):
                    problems.append((node.lineno, node.col_offset + 1,
                                     "E711 comparison to None (use `is` or `is not`)"))
    return [f"{path}:{line}:{col}: {msg}" for line, col, msg in sorted(set(problems))]


def lint_files(files: dict[str, str]) -> str:
    """The linter's report over several files: each problem, then the count."""
    problems = [p for path in sorted(files) for p in lint_source(path, files[path])]
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}" if problems \
        else f"no problems found in {len(files)} file{'s' if len(files) != 1 else ''}"
    return "\n".join([*problems, count])
