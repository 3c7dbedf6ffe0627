"""The SWE track's project templates: one small module each (a handful of functions with
docstrings), its names and constants drawn from the seed, and the calls its tests make.

A template's `source` is a `string.Template`: `$name` placeholders are filled with the drawn
parameters (a `Name` goes in as it is, anything else as its `repr`). `cases(rng, params)` gives,
per function, the calls its tests make, written relative to the module (`truncate('ab', 1)`);
the task generator (clawrl/envs/swe/tasks.py) runs them against the correct module for the
expected values, so a template never states an expected value by hand. Templates use no `while`
loops and no recursion: a seeded bug can break a function, never make it run forever.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawrl.envs.swe.sources import GRID, SETTINGS, SPANS, STOCK, TEXT


class Name(str):
    """A parameter that goes into the source as it is (an identifier), not as its repr."""


Cases = dict[str, list[str]]


@dataclass(frozen=True)
class Template:
    name: str
    modules: tuple[str, ...]  # the module's file name (without .py) is one of these
    source: str
    params: Callable[[random.Random], dict[str, Any]]
    cases: Callable[[random.Random, dict[str, Any]], Cases]


class Raw(str):
    """A call written into another call's arguments as code, not as a string."""

    def __repr__(self) -> str:
        return str(self)


def call(fn: str, *args: Any) -> Raw:
    """A call of the module's `fn`: `@` stands for the module, which the generator names."""
    return Raw(f"@{fn}({', '.join(repr(a) for a in args)})")


def meth(fn: str, *args: Any) -> str:
    return f".{fn}({', '.join(repr(a) for a in args)})"


WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "cable",
         "ocean", "pepper", "violet", "copper", "meadow", "falcon", "harbor", "ink", "sky",
         "at", "an", "of", "Bo", "EAGLE", "Orbit")


def _phrase(rng: random.Random, lo: int = 1, hi: int = 4) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _text_params(rng: random.Random) -> dict[str, Any]:
    return {"sep": rng.choice([", ", "-", " | ", "/", "; "]),
            "ellipsis": rng.choice(["...", "~", "..", "--"])}


def _text_cases(rng: random.Random, p: dict[str, Any]) -> Cases:
    phrases = [_phrase(rng) for _ in range(6)]
    long = [_phrase(rng, 3, 5) for _ in range(4)]
    return {
        "word_count": [call("word_count", t) for t in
                       ["", "  " + phrases[0] + "  ", phrases[1] + "\t" + phrases[2], *long[:3]]],
        "truncate": [call("truncate", t, w) for t, w in
                     [(long[0], len(long[0])), (long[1], 8), (phrases[0], 40), (long[2], 12),
                      (long[3], len(long[3]) - 1), ("abc", 3)]],
        "join_words": [call("join_words", ws) for ws in
                       [[], ["a", " ", "b "], phrases[:3], [" x", "", "y", "  "],
                        long[:2], [phrases[3]]]],
        "title_words": [call("title_words", t, n) for t, n in
                        [(long[0], 3), (long[1], 2), (long[2], 5), ("an ink sky", 3),
                         (phrases[4], 4), ("of at Bo", 2)]],
        "count_vowels": [call("count_vowels", t) for t in ["", "EAGLE", *long, phrases[5]]],
        "pad_right": [call("pad_right", t, w, f) for t, w, f in
                      [("ab", 5, "."), (phrases[0], len(phrases[0]), "*"), ("abcdef", 3, "-"),
                       (rng.choice(WORDS), 12, "_"), ("", 2, "#"), ("sky", 4, ".")]],
        "censor": [call("censor", t, w) for t, w in
                   [(long[0], long[0].split()[1]), ("an apple a day", "a"), (phrases[1], ""),
                    (long[1], "zzz"), ("ink and ink", "ink"), (long[2], long[2].split()[0])]],
        "initials": [call("initials", t, n) for t, n in
                     [(long[0], 2), (long[1], 1), (phrases[2], 3), ("ada bo cy", 3),
                      (long[2], 5), ("x", 1)]],
        "frame": [call("frame", t, w, f) for t, w, f in
                  [("ab", 4, "."), ("sky", 3, "*"), (phrases[3], 20, "-"), ("long text", 4, "_"),
                   ("", 1, "#")]],
    }


def _stock_params(rng: random.Random) -> dict[str, Any]:
    return {"Cls": Name(rng.choice(["Inventory", "Stock", "Pantry", "Store"])),
            "low": rng.randint(3, 6), "max": rng.choice([50, 60, 80, 99])}


def _stock_cases(rng: random.Random, p: dict[str, Any]) -> Cases:
    cls, low, top = p["Cls"], p["low"], p["max"]
    names = rng.sample(WORDS[:16], 4)

    def inv() -> str:
        counts = {n: rng.choice([0, 1, low - 1, low, low + 1, rng.randint(1, top)])
                  for n in rng.sample(names, rng.randint(2, 4))}
        return call(cls, counts)

    a, b = names[0], names[1]
    return {
        "add": [call(cls, {a: 2}) + meth("add", a, 3), call(cls, {}) + meth("add", b, 1),
                call(cls, {a: top - 2}) + meth("add", a, 5),
                call(cls, {a: 1}) + meth("add", a, -1),
                call(cls, {a: top}) + meth("add", b, top + 1), call(cls, {b: 4}) + meth("add", b, 0)],
        "remove": [call(cls, {a: 5}) + meth("remove", a, 2),
                   call(cls, {a: 5}) + meth("remove", b, 1),
                   call(cls, {a: 2}) + meth("remove", a, 3),
                   call(cls, {a: 3, b: 7}) + meth("remove", b, 7),
                   call(cls, {b: 9}) + meth("remove", b, 1)],
        "total": [call(cls, {}) + ".total()", *(inv() + ".total()" for _ in range(4))],
        "low_stock": [inv() + ".low_stock()" for _ in range(5)] +
                     [call(cls, {a: low, b: low - 1}) + ".low_stock()"],
        "restock_order": [inv() + meth("restock_order", t) for t in
                          (low, low + 5, 1, top, low - 1)],
        "value": [inv() + meth("value", {n: rng.randint(1, 9) for n in names[:3]})
                  for _ in range(4)] + [call(cls, {a: 3}) + meth("value", {})],
        "transfer": [call(cls, {a: 5}) + meth("transfer", call(cls, {}), a, 2),
                     call(cls, {a: 4, b: 1}) + meth("transfer", call(cls, {b: 2}), b, 1),
                     call(cls, {a: 3}) + meth("transfer", call(cls, {a: top - 1}), a, 3),
                     call(cls, {a: 1}) + meth("transfer", call(cls, {}), a, 2),
                     call(cls, {b: 8}) + meth("transfer", call(cls, {a: 1}), b, 6)],
    }


def _grid_params(rng: random.Random) -> dict[str, Any]:
    return {"empty": rng.choice([0, -1, 9])}


def _grid(rng: random.Random, rows: int, cols: int) -> list[list[int]]:
    return [[rng.randint(-3, 9) for _ in range(cols)] for _ in range(rows)]


def _grid_cases(rng: random.Random, p: dict[str, Any]) -> Cases:
    grids = [_grid(rng, rng.randint(2, 4), rng.randint(2, 5)) for _ in range(6)]
    square = _grid(rng, 3, 3)
    return {
        "make_grid": [call("make_grid", r, c) for r, c in [(1, 1), (2, 3), (3, 2), (0, 4), (4, 1)]],
        "transpose": [call("transpose", g) for g in [[], grids[0], grids[1], [[1, 2, 3]], square]],
        "row_sums": [call("row_sums", g) for g in [[], *grids[:4]]],
        "column_sum": [call("column_sum", g, c) for g, c in
                       [(grids[0], 0), (grids[1], 1), (grids[2], len(grids[2][0]) - 1),
                        (square, 2), (grids[3], 1)]],
        "neighbors": [call("neighbors", g, r, c) for g, r, c in
                      [(square, 1, 1), (square, 0, 0), (grids[0], 1, 0), (square, 2, 2),
                       (grids[1], 0, len(grids[1][0]) - 1), (grids[2], 1, 1)]],
        "count_above": [call("count_above", g, t) for g, t in
                        [(grids[0], 0), (grids[1], 5), (square, 9), (grids[2], -4),
                         (grids[3], square[1][1]), ([[1, 2], [2, 1]], 1)]],
        "get_cell": [call("get_cell", g, r, c) for g, r, c in
                     [(square, 1, 2), (square, 3, 0), (square, 0, 3), (grids[0], -1, 0),
                      (grids[1], 0, -1), (grids[2], len(grids[2]) - 1, 0), (square, 2, 2)]],
        "corners": [call("corners", g) for g in [square, *grids[:4], [[7]]]],
        "shift_row": [call("shift_row", row, s) for row, s in
                      [([1, 2, 3, 4], 1), ([], 3), ([5, 6, 7], 3), (grids[0][0], 2),
                       (grids[1][0], 7), ([1, 2], 0)]],
        "window_sums": [call("window_sums", row, n) for row, n in
                        [([1, 2, 3, 4], 2), ([5], 1), (grids[0][0], 1), ([3, 1, 4, 1, 5], 3),
                         ([2, 7], 3), (grids[1][0], 2)]],
        "scale": [call("scale", g, f) for g, f in [(grids[0], 2), (grids[1], -1), (square, 0),
                                                  ([[1, 2]], 3), (grids[2], 3)]],
    }


def _spans_params(rng: random.Random) -> dict[str, Any]:
    return {"slot": rng.choice([15, 20, 30])}


def _span(rng: random.Random) -> tuple[int, int]:
    start = rng.randrange(0, 1380, 5)
    return (start, start + rng.randrange(5, 120, 5))


def _spans_cases(rng: random.Random, p: dict[str, Any]) -> Cases:
    spans = [_span(rng) for _ in range(8)]
    slot = p["slot"]
    busy = [(540, 600), (590, 660), (720, 780), (900, 905)]
    return {
        "duration": [call("duration", s) for s in [*spans[:4], (60, 60)]],
        "overlaps": [call("overlaps", a, b) for a, b in
                     [((0, 10), (10, 20)), ((0, 11), (10, 20)), ((5, 8), (0, 30)),
                      (spans[0], spans[1]), ((100, 200), (50, 100)), ((30, 40), (0, 31)),
                      ((10, 20), (0, 10)), ((0, 5), (5, 9)), ((45, 50), (50, 60))]],
        "merge": [call("merge", s) for s in
                  [[], busy, [(10, 20), (20, 30)], spans[:4], [(50, 60), (0, 5)], spans[4:]]],
        "to_clock": [call("to_clock", m) for m in [0, 59, 60, 605, rng.randrange(1, 1440), 1439]],
        "round_up": [call("round_up", m) for m in
                     [0, slot, slot + 1, 2 * slot - 1, rng.randrange(1, 1000), 7 * slot]],
        "free_time": [call("free_time", b, s, e) for b, s, e in
                      [(busy, 480, 1020), ([], 0, 60), ([(0, 30)], 0, 60), (busy, 600, 700),
                       (spans[:3], 0, 1440), ([(50, 70)], 0, 60)]],
        "clamp": [call("clamp", s, lo, hi) for s, lo, hi in
                  [((10, 50), 0, 40), ((10, 50), 20, 100), ((0, 100), 10, 90), (spans[0], 0, 1440),
                   ((30, 60), 40, 45)]],
        "slots": [call("slots", s) for s in [(0, slot), (0, slot - 1), (10, 10 + 3 * slot + 1),
                                             spans[5], spans[6], (100, 100 + 5 * slot)]],
        "busy_minutes": [call("busy_minutes", b, s, e) for b, s, e in
                         [(busy, 480, 1020), ([], 0, 60), ([(0, 30)], 0, 60), (busy, 600, 700),
                          (spans[:3], 0, 1440)]],
    }


def _settings_params(rng: random.Random) -> dict[str, Any]:
    return {"comment": rng.choice(["#", ";", "//"]), "assign": rng.choice(["=", ":"])}


def _settings_cases(rng: random.Random, p: dict[str, Any]) -> Cases:
    c, a = p["comment"], p["assign"]
    keys = rng.sample(["Name", "port", "debug", "mode", "level", "user", "color", "retries"], 6)
    values = ["yes", "off", "8080", "-3", "fast", "True", "0", "blue sky", "-x"]
    lines = [f"{k} {a} {rng.choice(values)}" for k in keys]
    text = "\n".join([lines[0], f"{c} a comment", "", lines[1] + f"  {c} note", lines[2],
                      f"{keys[0]}{a}{rng.choice(values)}"])
    return {
        "strip_comment": [call("strip_comment", s) for s in
                          [lines[0], f"  {lines[1]} {c} why", f"{c} only", "", f"x{c}{c}y"]],
        "parse_value": [call("parse_value", v) for v in [*values, "ON", "No", "12a", "-"]],
        "parse_line": [call("parse_line", s) for s in
                       [lines[2], f"  {c} x", "", f"Key{a}{a}v", lines[3] + f" {c} c",
                        "no assign here"]],
        "parse_text": [call("parse_text", t) for t in
                       [text, "", "\n".join(lines[3:]), "\n".join(reversed(lines)),
                        f"{c} {keys[1]} {a} 1\n{lines[4]}"]],
        "parse_list": [call("parse_list", t, s) for t, s in
                       [("a, b,,c", ","), ("x;y; ;z", ";"), ("", ","), ("one", "|"),
                        (" p / q ", "/")]],
        "count_prefixed": [call("count_prefixed", text, pre) for pre in
                           [keys[0][:2].lower(), "", "zz", keys[1].lower()[:1]]],
        "render": [call("render", s) for s in
                   [{}, {"b": 1, "a": "x"}, {"port": 80}, {k.lower(): 1 for k in keys[:4]}]],
        "get_setting": [call("get_setting", text, k, d) for k, d in
                        [(keys[0], None), (keys[1].upper(), 0), ("missing", "none"),
                         (keys[2], -1), ("", "empty")]],
    }


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("text", ("textkit", "strtools", "wordsmith"), TEXT, _text_params, _text_cases),
    Template("stock", ("inventory", "stockroom", "pantry"), STOCK, _stock_params, _stock_cases),
    Template("grid", ("grids", "gridkit", "boards"), GRID, _grid_params, _grid_cases),
    Template("settings", ("settings", "confparse", "kvparse"), SETTINGS, _settings_params,
             _settings_cases),
    Template("spans", ("spans", "timespans", "agenda"), SPANS, _spans_params, _spans_cases),
)}
