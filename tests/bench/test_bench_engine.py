"""`clawrl bench engine` runs end to end on the tiny model and reports a real cache hit (its
figures are only printed, never asserted: speed is measured by the bench, not by tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawrl.bench.engine import main


def test_bench_engine_prints_every_figure(tiny_model_dir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), "--reps", "1", "--prefix-tokens", "128",
                 "--suffix-tokens", "8", "--new-tokens", "4", "--no-llama-cpp"]) == 0
    out = capsys.readouterr().out
    assert "decode, 1 concurrent:" in out and "decode, 8 concurrent:" in out
    assert "(128 tokens cached)" in out and "cache off:" in out
    assert "decode ceiling" in out
