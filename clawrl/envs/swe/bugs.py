"""The bug kinds the SWE track seeds, and where each can go in a module's source.

`find_sites(source, rng)` reads the correct module's syntax tree and lists every place a bug
of each kind could be seeded, as a text edit of the source (so the buggy file differs from the
correct one in exactly that span, its formatting and docstrings untouched, and the fix is the
edit undone). Which of them makes a *task* (the tests catch it) is the generator's business
(clawrl/envs/swe/tasks.py). The kinds:

- wrong_operator: `+`/`-` swapped, `*` -> `+`, `//` <-> `%`, `+=` <-> `-=`, `and` <-> `or`;
- off_by_one: a small integer literal (0, 1, 2) in a function moved by one;
- wrong_constant: a module constant's value or a string literal in a function changed;
- swapped_arguments: a call's first two positional arguments exchanged;
- missing_branch: an `if` (without else) or an `elif` branch deleted, lines and all;
- wrong_comparison: `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("wrong_operator", "off_by_one", "wrong_constant", "swapped_arguments",
         "missing_branch", "wrong_comparison")

BIN_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}
BIN_SWAP = {"+": "-", "-": "+", "*": "+", "//": "%", "%": "//"}
CMP_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
           ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in"}
CMP_SWAP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
            "in": "not in", "not in": "in"}
BOOL_OPS = {ast.And: "and", ast.Or: "or"}
CHARS = (",", ";", ":", "|", "#", "=", "-", "*", ".", "_", " ")


@dataclass(frozen=True)
class Edit:
    """Replace source[start:end] with `new`."""

    start: int
    end: int
    new: str

    def apply(self, source: str) -> str:
        return source[:self.start] + self.new + source[self.end:]


@dataclass(frozen=True)
class Site:
    kind: str
    where: str        # the function (`Cls.method`) or module constant the bug is in
    edit: Edit        # correct source -> buggy source
    description: str  # what changed, for the episode's details


class _Source:
    """Offsets of (line, column) positions, and the text of nodes and spans."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0]
        for line in text.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.at(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def between(self, a: ast.AST, b: ast.AST, word: str) -> Edit | None:
        """The span of operator `word` in the text between nodes a and b (parentheses and
        blanks around it stay)."""
        lo, hi = self.end(a), self.start(b)
        pattern = r"\b" + word.replace(" ", r"\s+") + r"\b" if word[0].isalpha() \
            else re.escape(word)
        found = re.search(pattern, self.text[lo:hi])
        return None if found is None else Edit(lo + found.start(), lo + found.end(), "")


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield f"{node.name}.{item.name}", item


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _changed(value: object, rng: random.Random) -> object:
    """A wrong value for a constant: clearly not an off-by-one."""
    if isinstance(value, int):
        return rng.choice([c for c in (value * 2, value + 7, value // 2) if c != value])
    if isinstance(value, float):
        return value * 2
    assert isinstance(value, str)
    if len(value) >= 2:
        return value[:-1]
    return rng.choice([c for c in CHARS if c != value]) if value else " "


def _op_sites(src: _Source, where: str, node: ast.AST) -> Iterator[Site]:
    """wrong_operator and wrong_comparison sites of one node."""
    pairs: list[tuple[str, ast.AST, ast.AST, str, str]] = []
    if isinstance(node, ast.BinOp) and type(node.op) in BIN_OPS:
        op = BIN_OPS[type(node.op)]
        pairs.append(("wrong_operator", node.left, node.right, op, BIN_SWAP[op]))
    elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub):
        op = BIN_OPS[type(node.op)] + "="
        pairs.append(("wrong_operator", node.target, node.value, op, BIN_SWAP[op[0]] + "="))
    elif isinstance(node, ast.BoolOp):
        op = BOOL_OPS[type(node.op)]
        other = "or" if op == "and" else "and"
        pairs += [("wrong_operator", a, b, op, other)
                  for a, b in zip(node.values, node.values[1:], strict=False)]
    elif isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        pairs += [("wrong_comparison", operands[i], operands[i + 1], CMP_OPS[type(op)],
                   CMP_SWAP[CMP_OPS[type(op)]])
                  for i, op in enumerate(node.ops) if type(op) in CMP_OPS]
    for kind, a, b, old, new in pairs:
        span = src.between(a, b, old)
        if span is not None:
            yield Site(kind, where, Edit(span.start, span.end, new), f"`{old}` became `{new}`")


def _branch_sites(src: _Source, where: str, body: list[ast.stmt]) -> Iterator[Site]:
    """missing_branch sites in one statement list: an `if` without else (when the list keeps
    another statement), or the `elif` of an `if`."""
    lines = src.text.splitlines()
    for stmt in body:
        if not isinstance(stmt, ast.If):
            continue
        branch: ast.If | None = None
        if not stmt.orelse and len(body) >= 2:
            branch, last = stmt, stmt.end_lineno
        elif (len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
              and lines[stmt.orelse[0].lineno - 1].lstrip().startswith("elif ")):
            branch = stmt.orelse[0]
            last = branch.body[-1].end_lineno
        if branch is not None and last is not None:
            head = lines[branch.lineno - 1].strip()
            yield Site("missing_branch", where,
                       Edit(src.at(branch.lineno, 0), src.at(last + 1, 0), ""),
                       f"the branch `{head}` was deleted")


def find_sites(source: str, rng: random.Random) -> list[Site]:
    """Every place a bug of each kind could go in `source` (a module), in source order per
    function; random choices (which way off by one, which wrong value) from `rng`."""
    tree = ast.parse(source)
    src = _Source(source)
    docs = _docstrings(tree)
    sites: list[Site] = []
    for stmt in tree.body:  # module constants: NAME = literal
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id.isupper()
                and isinstance(stmt.value, ast.Constant)
                and type(stmt.value.value) in (int, float, str)):
            value = stmt.value.value
            wrong = _changed(value, rng)
            sites.append(Site("wrong_constant", stmt.targets[0].id,
                              Edit(src.start(stmt.value), src.end(stmt.value), repr(wrong)),
                              f"{stmt.targets[0].id} became {wrong!r} (was {value!r})"))
    for where, func in _functions(tree):
        for node in ast.walk(func):
            sites += _op_sites(src, where, node)
            if isinstance(node, ast.Constant) and id(node) not in docs:
                value = node.value
                if type(value) is int and 0 <= value <= 2:
                    new = value + 1 if value == 0 or rng.random() < 0.5 else value - 1
                    sites.append(Site("off_by_one", where, Edit(src.start(node), src.end(node),
                                                               str(new)),
                                      f"{value} became {new}"))
                elif type(value) is str or (type(value) is int and value > 2):
                    wrong = _changed(value, rng)
                    sites.append(Site("wrong_constant", where,
                                      Edit(src.start(node), src.end(node), repr(wrong)),
                                      f"{value!r} became {wrong!r}"))
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and not any(isinstance(a, ast.Starred) for a in node.args[:2])):
                a, b = node.args[0], node.args[1]
                ta, tb = (src.text[src.start(n):src.end(n)] for n in (a, b))
                if ta != tb:
                    gap = src.text[src.end(a):src.start(b)]
                    sites.append(Site("swapped_arguments", where,
                                      Edit(src.start(a), src.end(b), tb + gap + ta),
                                      f"the arguments {ta} and {tb} were swapped"))
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                    sites += _branch_sites(src, where, stmts)
    return sites
