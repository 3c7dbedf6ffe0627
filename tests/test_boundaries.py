"""Dependency direction (docs/architecture.md): the rooms of the house and the one-way
arrows between them, read from the code's own imports; the proxy and judge never import
torch and friends."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

HEAVY = ("torch", "transformers", "megatron", "sglang", "peft", "xgrammar")


def test_proxy_and_judge_do_not_import_heavy_packages() -> None:
    # A fresh interpreter: this test process may already hold torch from other tests.
    code = (
        "import sys, pkgutil, importlib\n"
        "import proxy, judge, clawrl.base, clawrl.cli\n"
        "for pkg in (proxy, judge, clawrl.base, clawrl.cli):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.endswith('__main__'):\n"
        "            importlib.import_module(m.name)\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r}]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_help_is_instant_and_light() -> None:
    code = "import sys; from clawrl.cli.main import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False")
    assert "clawrl COMMAND" in out.stdout


PACKAGES = ("clawrl", "proxy", "judge", "trainer", "migrations")


# The rooms and what each may import besides itself (docs/architecture.md keeps this table).
# `clawrl.cli.main` dispatches to every room by module name, which is not an import.
ROOMS: dict[str, set[str]] = {
    "clawrl.base": set(),
    "migrations": {"clawrl.base"},
    "clawrl.engine": set(),
    "proxy": {"clawrl.base"},
    "judge": {"clawrl.base"},
    "trainer": {"clawrl.base", "clawrl.engine"},
    "clawrl.cli": {"clawrl.base", "proxy", "judge"},
    "clawrl.world": set(),
    "clawrl.judgemodel": {"clawrl.base", "clawrl.engine", "judge", "clawrl.world"},
    "clawrl.envs": {"clawrl.base", "proxy", "clawrl.world"},
    "clawrl.swemodel": {"clawrl.engine", "clawrl.world", "clawrl.envs"},
    "clawrl.eval": {"clawrl.base", "proxy", "clawrl.cli", "clawrl.world", "clawrl.envs"},
    "clawrl.bench": {"clawrl.base", "clawrl.engine", "proxy", "judge", "trainer", "clawrl.cli",
                     "clawrl.world", "clawrl.envs", "clawrl.judgemodel", "clawrl.eval"},
}


def room_of(module: str) -> str | None:
    """`clawrl.engine.server` -> `clawrl.engine`; `proxy.console.pages` -> `proxy`; the
    `clawrl` package's own docstring belongs to no room."""
    parts = module.split(".")
    name = ".".join(parts[:2]) if parts[0] == "clawrl" else parts[0]
    return name if name in ROOMS else None


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        room = room_of(module)
        for dep in deps:
            other = room_of(dep)
            if room and other and other != room and other not in ROOMS[room]:
                bad.append(f"{module} -> {dep}")
    return sorted(bad)


def test_every_module_is_in_a_room_and_no_arrow_climbs() -> None:
    graph = _module_graph()
    homeless = [m for m in graph if room_of(m) is None and m != "clawrl"]
    assert homeless == []
    assert upward_arrows(graph) == []


def test_an_upward_arrow_is_found() -> None:
    """The check above can fail: the base importing the proxy, the trainer importing the tiny
    world or the proxy importing the trainer, each wired into the real graph, is reported."""
    for src, dst in (("clawrl.base.db", "proxy.chat"), ("trainer.train", "clawrl.world.town"),
                     ("proxy.console.actions", "trainer.versions")):
        graph = _module_graph()
        graph[src].add(dst)
        assert upward_arrows(graph) == [f"{src} -> {dst}"]


def _module_graph() -> dict[str, set[str]]:
    """Every project module and the project modules it imports, wherever the import sits
    (top level, inside a function, under TYPE_CHECKING): a circle through a lazy import is
    still a circle a reader has to untangle."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    modules: dict[str, pathlib.Path] = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path

    def resolve(name: str) -> str | None:
        # `from a.b import c`: c may be a module (a.b.c) or a name in a.b.
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from a.b import c`: the module a.b.c when there is one, else a.b.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                dep = resolve(target)
                # A package's __init__ is not a dependency of its own modules' imports of
                # siblings (every __init__ here holds only a docstring, `test_package_inits…`).
                if dep and dep != name and not (dep in PACKAGES and dep != target):
                    deps.add(dep)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    graph = _module_graph()
    assert "clawrl.eval.stack" in graph and "clawrl.world.pretrain" in graph
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a two-module and a three-module circle are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    # and it reads lazy imports: a real module pair wired into a circle is reported
    graph = _module_graph()
    graph["clawrl.world.model"].add("clawrl.world.pretrain")
    assert ["clawrl.world.model", "clawrl.world.pretrain"] in [
        [m for m in c if m in ("clawrl.world.model", "clawrl.world.pretrain")]
        for c in _cycles(graph)]


def test_package_inits_say_what_lives_there() -> None:
    """Each subpackage's __init__ is a docstring (what lives there, what it may import)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    for pkg in PACKAGES:
        for init in (root / pkg).rglob("__init__.py"):
            if init.parent.name == "versions":
                continue
            tree = ast.parse(init.read_text())
            assert ast.get_docstring(tree), f"{init} has no docstring"
            assert all(isinstance(n, ast.Expr) for n in tree.body), f"{init} holds code"


def _project_text_files() -> list[Any]:
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [root / "README.md", root / "Makefile", root / "pyproject.toml"]
    for folder in ("clawrl", "proxy", "judge", "trainer", "migrations", "tests", "docs",
                   "deploy"):
        files += [p for p in (root / folder).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".md", ".txt", ".sh", ".service", ".example", ".ini")]
    return files


def test_every_cited_document_is_in_the_repo() -> None:
    """A reader can open every `docs/...` page the code, tests and docs cite, and no file
    sends them to a path on somebody's machine."""
    import re

    root = _project_text_files()[0].parent
    cited = 0
    for path in _project_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for ref in re.findall(r"\bdocs/[\w./-]+\.(?:md|png|jsonl)", text):
            cited += 1
            assert (root / ref).is_file(), f"{path.relative_to(root)} cites missing {ref}"
        if path.name != "test_boundaries.py":
            for bad in ("/work/", "/root/", "/home/", "/Users/"):
                assert bad not in text, f"{path.relative_to(root)} names a machine path {bad}"
    assert cited >= 5
