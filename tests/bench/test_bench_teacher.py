"""`clawrl bench teacher`: the teacher's prompts carry each hint as the trainer's do, and the
command prints one row per hint (on the CI-sized tiny world model; the figures that matter
are SmolLM2's, docs/results/2026-12-08-everyday-dev-runs.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawrl.bench import teacher

PREBUILT_CI = Path(__file__).resolve().parents[2] / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"


def test_the_teacher_bench_prints_a_row_per_hint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "teacher.json"
    assert teacher.main(["--model", str(PREBUILT_CI), "--hints", "brief,lowercase",
                         "--limit", "2", "--max-tokens", "4", "--threads", "1",
                         "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[2:]] == ["none", "brief", "lowercase"]
    figures = json.loads(out.read_text())["figures"]
    assert figures["brief"]["hint"] == teacher.TEACHER_HINTS["brief"]
    assert figures["none"]["hint"] is None
    assert all(0 <= v <= 1 for f in figures.values() for v in f["satisfied"].values())


def test_the_teacher_prompt_is_the_trainers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint reaches the prompt through judge/prompts.py `teacher_messages`, the function
    the judge worker builds the teacher's context with."""
    from judge import prompts

    seen: list[str] = []
    real = prompts.teacher_messages

    def spy(messages, hint, *a, **k):  # type: ignore[no-untyped-def]
        seen.append(hint)
        return real(messages, hint, *a, **k)

    monkeypatch.setattr(prompts, "teacher_messages", spy)
    teacher.measure(PREBUILT_CI, ["one_paragraph"], "dev", 2, limit=1)
    assert seen == [teacher.TEACHER_HINTS["one_paragraph"]]


@pytest.mark.parametrize("argv", [["--hints", "shouting"], ["--max-tokens", "0"]])
def test_bad_arguments_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        teacher.parse_args(argv)
    assert exc.value.code == 2 and "clawrl bench teacher" in capsys.readouterr().err
