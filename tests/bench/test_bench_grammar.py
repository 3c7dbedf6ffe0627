"""`clawrl bench grammar` runs end to end on the tiny model (its figures are only printed,
never asserted: speed is measured by the bench, not by tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawrl.bench.grammar import main


def test_bench_grammar_prints_every_figure(tiny_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), "--reps", "1", "--records", "1",
                 "--batch", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "compile: first" in out and "decode, 2 concurrent: free" in out
    assert "constrained" in out and "grammar alone" in out and "a reply parses: 1 records" in out
