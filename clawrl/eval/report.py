"""What a `clawrl eval` run prints and draws: the table (round x method x user), the issue's
targets per method and seed, and the learning curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawrl.eval.config import (
    TARGET_ACCURACY_DROP,
    TARGET_PREFS,
    TARGET_SATISFIED,
)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _cell(rows: list[dict[str, Any]], key: str, **match: Any) -> list[Any]:
    return [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]


def print_table(rows: list[dict[str, Any]]) -> str:
    """Satisfaction (and task accuracy) per round, method and user, as plain text: the mean
    over seeds, with the version served (the one version when all seeds served it)."""
    users = sorted({(r["user"], r["pref"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))  # in the order they ran
    cols = [(m, u) for m in methods for u, _ in users]
    seeds = sorted({r.get("seed", 0) for r in rows})
    head = "round  " + "  ".join(f"{m}/{u.split('-', 2)[-1]:<10}"[:22].ljust(22)
                                 for m, u in cols)
    lines = [f"mean over seeds {','.join(map(str, seeds))}"] if len(seeds) > 1 else []
    lines.append(head)
    for rnd in sorted({r["round"] for r in rows}):
        cells = []
        for m, u in cols:
            cell = {"round": rnd, "method": m, "user": u}
            versions = set(_cell(rows, "version", **cell))
            if not versions:
                cells.append("-".ljust(22))
                continue
            version = versions.pop() if len(versions) == 1 else "*"
            cells.append(f"{_mean(_cell(rows, 'satisfied', **cell)):.2f} (v{version}, acc "
                         f"{_mean(_cell(rows, 'correct', **cell)):.2f})".ljust(22))
        lines.append(f"{rnd:<5}  " + "  ".join(cells))
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation's targets per method and seed, from the probe rows.

    `reached`: per preference, the first round whose satisfaction (mean over that
    preference's users) is >= TARGET_SATISFIED, or None. `accuracy_base` is round 0's mean
    answer accuracy over all users; `worst_accuracy_drop` the largest fall below it in any
    later round, `final_accuracy_drop` the fall at the last round. `met`: at least
    TARGET_PREFS preferences (all of them, when fewer were run) reached the bar and accuracy
    never fell more than TARGET_ACCURACY_DROP. For `none`, `spread` is how far satisfaction
    moved from round 0 at most (it should stay at the base rate).
    """
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):  # in the order they ran
        for seed in sorted({r.get("seed", 0) for r in rows if r["method"] == method}):
            mine = [r for r in rows if r["method"] == method and r.get("seed", 0) == seed]
            rounds = sorted({r["round"] for r in mine})
            if 0 not in rounds:
                continue
            prefs = sorted({r["pref"] for r in mine})
            sat = {p: {n: _mean(_cell(mine, "satisfied", pref=p, round=n)) for n in rounds}
                   for p in prefs}
            acc = {n: _mean(_cell(mine, "correct", round=n)) for n in rounds}
            reached = {p: next((n for n in rounds if n > 0 and sat[p][n] >= TARGET_SATISFIED),
                               None) for p in prefs}
            drops = [acc[0] - acc[n] for n in rounds if n > 0] or [0.0]
            need = min(TARGET_PREFS, len(prefs))
            row: dict[str, Any] = {
                "method": method, "seed": seed, "rounds": rounds[-1],
                "base": {p: round(sat[p][0], 4) for p in prefs},
                "last": {p: round(sat[p][rounds[-1]], 4) for p in prefs},
                "reached": reached, "accuracy_base": round(acc[0], 4),
                "worst_accuracy_drop": round(max(drops), 4),
                "final_accuracy_drop": round(drops[-1], 4),
                "spread": round(max(abs(sat[p][n] - sat[p][0]) for p in prefs
                                    for n in rounds), 4)}
            row["met"] = (sum(n is not None for n in reached.values()) >= need
                          and row["worst_accuracy_drop"] <= TARGET_ACCURACY_DROP)
            out.append(row)
    return out


def print_targets(summary: list[dict[str, Any]]) -> str:
    """One line per method and seed: when each preference reached the bar, accuracy."""
    lines = [f"targets: satisfaction >= {TARGET_SATISFIED} for {TARGET_PREFS} preferences, "
             f"accuracy never more than {TARGET_ACCURACY_DROP * 100:.0f} points below base"]
    for t in summary:
        if t["method"] == "none":
            detail = (", ".join(f"{p} {t['base'][p]:.2f}" for p in t["base"])
                      + f" at round 0; moved at most {t['spread']:.2f}")
        else:
            detail = ", ".join(
                f"{p} {t['base'][p]:.2f}->{t['last'][p]:.2f} "
                + (f"(>= {TARGET_SATISFIED} at round {n})" if n is not None else "(not reached)")
                for p, n in t["reached"].items())
            detail += "  " + ("MET" if t["met"] else "not met")
        lines.append(
            f"  {t['method']:<9} seed {t['seed']}: {detail}; accuracy {t['accuracy_base']:.2f} "
            f"at round 0, worst {-t['worst_accuracy_drop'] * 100:+.1f} pts, "
            f"last {-t['final_accuracy_drop'] * 100:+.1f} pts")
    return "\n".join(lines)


def plot_curve(rows: list[dict[str, Any]], path: Path) -> None:
    """One panel per preference (satisfaction per round and method), and one of the answers'
    task accuracy (mean over users) per round and method. With several seeds: the mean
    line and a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefs = sorted({r["pref"] for r in rows})
    seeds = sorted({r.get("seed", 0) for r in rows})
    panels = [("tool-call track: held-out episodes solved", "success rate", "satisfied", p)
              if p == "toolcall" else
              (f"preference: {p}", "held-out replies satisfying it", "satisfied", p)
              for p in prefs] + [("answer accuracy (all users)", "held-out answers correct",
                                  "correct", None)]
    methods = list(dict.fromkeys(r["method"] for r in rows))  # in the order they ran
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, ylabel, key, pref) in zip(axes[0], panels, strict=True):
        for method in methods:
            # per round: the value of each seed (mean over that seed's matching users)
            pts: dict[int, list[float]] = {}
            for seed in seeds:
                mine = [r for r in rows if r["method"] == method and r.get("seed", 0) == seed
                        and pref in (None, r["pref"])]
                for n in sorted({r["round"] for r in mine}):
                    pts.setdefault(n, []).append(_mean(_cell(mine, key, round=n)))
            if pts:
                xs = sorted(pts)
                (line,) = ax.plot(xs, [_mean(pts[x]) for x in xs], marker="o", label=method)
                if len(seeds) > 1:
                    ax.fill_between(xs, [min(pts[x]) for x in xs], [max(pts[x]) for x in xs],
                                    color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(title + (f" ({len(seeds)} seeds)" if len(seeds) > 1 else ""))
        ax.set_xlabel("round (one published version per round when training)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
