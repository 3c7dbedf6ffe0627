"""The SWE track's task generator: a small Python project with one seeded bug, from a seed.

    task = draw_task(seed=7, split="train")
    task.files        # the buggy project: the module, its visible tests, a README
    task.hidden       # the hidden tests' source, for people (never in the sandbox)
    task.hidden_calls # the hidden tests as calls and the answers they expect (the verdict)
    task.fix_diff     # a unified diff that fixes the bug (the generator knows it)

A task is a template (clawrl/envs/swe/templates.py) filled from the seed (module name, class
name, constants, test inputs) with one bug of one kind (clawrl/envs/swe/bugs.py) at one site
(the function and the place in it drawn from the seed too). A site only makes a task when the
bug is caught: the buggy module, run against the correct module's answers, fails at least two
of the calls; then one failing call is among the visible tests (two per function, drawn
before the bug; a failing hidden one takes a visible one's place when none fails) and at least
one among the hidden tests. Else the next site is tried, then a new draw.

The split, by template AND by bug kind:

- templates text, stock, grid, settings are held in; spans is held out;
- kinds wrong_operator, off_by_one, wrong_constant, swapped_arguments, missing_branch are held
  in; wrong_comparison is held out;
- `train` draws a held-in template with a held-in kind (4 x 5 pairs); `heldout` every pair with
  a held-out template or a held-out kind (10 pairs); task `seed` takes pair `seed % pairs`.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import random
import string
import types
from dataclasses import dataclass
from typing import Any

from clawrl.envs.protocol import EnvError
from clawrl.envs.swe.bugs import KINDS, Site, find_sites
from clawrl.envs.swe.templates import TEMPLATES, Name, Template

HELDOUT_TEMPLATES = ("spans",)
HELDOUT_KINDS = ("wrong_comparison",)
SPLITS = ("train", "heldout")
VISIBLE_PER_FUNCTION = 2


def pairs(split: str) -> list[tuple[str, str]]:
    """The (template, kind) pairs of a split, in a fixed order."""
    if split not in SPLITS:
        raise EnvError(f"unknown split {split!r} (train or heldout)")
    held_out = [(t, k) for t in TEMPLATES for k in KINDS
                if t in HELDOUT_TEMPLATES or k in HELDOUT_KINDS]
    return held_out if split == "heldout" else [(t, k) for t in TEMPLATES for k in KINDS
                                                if (t, k) not in held_out]


@dataclass(frozen=True)
class Task:
    name: str          # template/kind/where, e.g. "text/off_by_one/truncate"
    split: str
    template: str
    kind: str
    where: str         # the function or module constant holding the bug
    description: str   # what the bug changed
    module: str        # the module's file, e.g. "textkit.py"
    files: dict[str, str]
    fixed: str         # the module's correct source
    fix_diff: str      # unified diff: buggy -> correct
    hidden: str        # the hidden tests' source, for people
    hidden_count: int
    visible_count: int
    # The hidden tests as the verdict runs them (clawrl/envs/swe/verdict.py): each call with
    # the module's name (`textkit.truncate('abc', 2)`) and what it must give, (False, the
    # value's repr) or (True, the exception's class name).
    hidden_calls: tuple[tuple[str, bool, str], ...] = ()

    @property
    def test_file(self) -> str:
        return f"tests/test_{self.module[:-3]}.py"


Outcome = tuple[bool, Any]  # (raised, the value or the exception)
Case = tuple[str, str, Outcome]  # (function, call with `@` for the module, expected outcome)


def _load(source: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)  # noqa: S102 - our templates
    return module


def _run(module: types.ModuleType, expr: str) -> Outcome:
    try:
        return False, eval(expr, {module.__name__: module})  # noqa: S307 - our own calls
    except Exception as exc:  # noqa: BLE001 - a raised exception is the outcome
        return True, exc


def _passes(got: Outcome, expected: Outcome) -> bool:
    """What the generated test checks: the same value (==), or an exception of the expected
    type (`except ValueError:`)."""
    if expected[0]:
        return got[0] and isinstance(got[1], type(expected[1]))
    try:
        return not got[0] and bool(got[1] == expected[1])
    except Exception:  # noqa: BLE001 - a broken value compares as a failure
        return False


def _test(module: str, index: int, fn: str, expr: str, expected: Outcome) -> str:
    call = expr.replace("@", module + ".")
    if expected[0]:
        exc = type(expected[1]).__name__
        return (f"def test_{fn}_{index}():\n    try:\n        got = {call}\n"
                f"    except {exc}:\n        return\n"
                f"    raise AssertionError({call + ' returned '!r} + repr(got) + "
                f"{', expected ' + exc!r})\n")
    want = repr(expected[1])
    op = "is" if expected[1] is None else "=="
    return (f"def test_{fn}_{index}():\n    got = {call}\n"
            f"    assert got {op} {want}, {call + ' returned '!r} + repr(got) + "
            f"{', expected ' + want!r}\n")


def _test_file(module: str, title: str, tests: list[str]) -> str:
    return f'"""{title}"""\n\nimport {module}\n\n\n' + "\n\n".join(tests)


def _expected(module: types.ModuleType, expr: str) -> Outcome:
    got = _run(module, expr)
    if got[0]:
        assert getattr(builtins, type(got[1]).__name__, None) is type(got[1]), expr
    else:
        # The verdict reads a value back as a literal (clawrl/envs/swe/verdict.py).
        assert ast.literal_eval(repr(got[1])) == got[1], \
            f"{expr} returns a value without a literal repr"
    return got


def _draw(template: Template, kind: str, rng: random.Random, split: str) -> Task | None:
    params = template.params(rng)
    module = rng.choice(template.modules)
    source = string.Template(template.source).substitute(
        {k: v if isinstance(v, Name) else repr(v) for k, v in params.items()})
    correct = _load(source, module)
    cases: list[list[Case]] = []  # per function, shuffled
    for fn, exprs in template.cases(rng, params).items():
        exprs = list(exprs)
        rng.shuffle(exprs)
        cases.append([(fn, e, _expected(correct, e.replace("@", module + "."))) for e in exprs])
    sites = [s for s in find_sites(source, rng) if s.kind == kind]
    rng.shuffle(sites)
    for site in sites:
        buggy = site.edit.apply(source)
        try:
            mutant = _load(buggy, module)
        except Exception:  # noqa: BLE001 - a site whose edit breaks the module is no task
            continue
        caught = [[not _passes(_run(mutant, e.replace("@", module + ".")), want)
                   for _, e, want in fn_cases] for fn_cases in cases]
        if sum(map(sum, caught)) >= 2:
            visible, hidden = _split_cases(cases, caught)
            return _task(template, site, module, source, buggy, visible, hidden, split)
    return None


def _split_cases(cases: list[list[Case]], caught: list[list[bool]]
                 ) -> tuple[list[Case], list[Case]]:
    """Visible: the first calls of each function, the rest hidden. At least two calls fail
    with the bug; when they all landed on one side, one of them swaps places with a call of
    its function on the other side, so that each side has one."""
    n = VISIBLE_PER_FUNCTION

    def swap(f: int, i: int, j: int) -> None:
        cases[f][i], cases[f][j] = cases[f][j], cases[f][i]
        caught[f][i], caught[f][j] = caught[f][j], caught[f][i]

    if not any(any(c[:n]) for c in caught):
        f = next(f for f, c in enumerate(caught) if any(c[n:]))
        swap(f, 0, caught[f].index(True, n))
    elif not any(any(c[n:]) for c in caught):
        f = next(f for f, c in enumerate(caught) if any(c[:n]))  # >= 2 visible: one moves
        swap(f, caught[f].index(True), n)
    visible = [c for fn_cases in cases for c in fn_cases[:n]]
    hidden = [c for fn_cases in cases for c in fn_cases[n:]]
    return visible, hidden


def _task(template: Template, site: Site, module: str, source: str, buggy: str,
          visible: list[Case], hidden: list[Case],
          split: str) -> Task:
    def tests(cases: list[Case]) -> list[str]:
        counts: dict[str, int] = {}
        out = []
        for fn, expr, want in cases:
            counts[fn] = counts.get(fn, 0) + 1
            out.append(_test(module, counts[fn], fn, expr, want))
        return out

    title = source.split('"""')[1]
    readme = (f"# {module}\n\n{title}\n\nThe tests are in tests/test_{module}.py (run them with "
              "the run_tests tool). Some of them fail: the code has a bug.\n")
    files = {f"{module}.py": buggy, "README.md": readme,
             f"tests/test_{module}.py": _test_file(module, f"Tests of {module}.", tests(visible))}
    diff = "".join(difflib.unified_diff(buggy.splitlines(keepends=True),
                                        source.splitlines(keepends=True),
                                        f"a/{module}.py", f"b/{module}.py"))
    calls = tuple((expr.replace("@", module + "."), raised,
                   type(value).__name__ if raised else repr(value))
                  for _, expr, (raised, value) in hidden)
    return Task(f"{template.name}/{site.kind}/{site.where}", split, template.name, site.kind,
                site.where, site.description, f"{module}.py", files, source, diff,
                _test_file(module, f"Hidden tests of {module}.", tests(hidden)),
                len(hidden), len(visible), calls)


def draw_task(seed: int, split: str = "train") -> Task:
    """The task of episode `seed` in `split` (see the module docstring)."""
    choices = pairs(split)
    template_name, kind = choices[seed % len(choices)]
    rng = random.Random(f"swe-{split}-{seed}")
    for _ in range(20):  # a draw whose tests catch no site of the kind: draw again
        task = _draw(TEMPLATES[template_name], kind, rng, split)
        if task is not None:
            return task
    raise RuntimeError(f"template {template_name!r} has no {kind} bug its tests catch")
