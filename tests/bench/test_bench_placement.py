"""`clawrl bench placement` runs for real on the tiny test model (a random judge adapter on
it) and prints every figure; bad arguments are one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loras import make_adapters_in_child
from oneline import one_line_exit

from clawrl.bench.placement import main

ROOT = Path(__file__).resolve().parents[2]
NUM = r"([\d,]+\.?\d*)"


def _num(pattern: str, text: str) -> list[float]:
    found = re.search(pattern, text)
    assert found, f"no line matches {pattern!r} in:\n{text}"
    return [float(g.replace(",", "")) for g in found.groups()]


def test_bench_placement_prints_every_figure(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = make_adapters_in_child(tiny_model_dir, {tmp_path / "judge-adapter": 1})[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "bench", "placement", "--quick",
         "--state-dir", str(tmp_path / "state"), "--base", str(tiny_model_dir),
         "--judge-adapter", str(adapter), "--rounds", "2", "--policy-threads", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    # The judge engine runs as `clawrl judge serve` does; the one engine in float32.
    assert re.search(r"two engines = policy engine \(float32, threads 1, policy-v1\) \+ judge "
                     r"engine \(merged, (float32|bfloat16), n-gram drafts, threads 1\); one "
                     r"engine = base \(float32, threads 1\)", out), out
    for rnd in (1, 2):
        figures = _num(rf"round {rnd}: two engines: judge p50 {NUM} ms \({NUM} requests\), "
                       rf"policy {NUM} tokens/s  \|  one engine: judge p50 {NUM} ms \({NUM} "
                       rf"requests\), policy {NUM} tokens/s", out)
        assert min(figures) > 0
    memory = {}
    for place, procs in (("two engines", "2 processes"), ("one engine", "1 process")):
        for when in ("idle", "after traffic"):
            rss, pss = _num(rf"memory, {place}, {when}: RSS {NUM} MB  PSS {NUM} MB "
                            rf"\({procs}\)", out)
            assert 0 < pss <= rss
            memory[place, when] = rss
        p50, p90, n = _num(rf"judge latency, {place}: p50 {NUM} ms  p90 {NUM} ms \({NUM} "
                           rf"requests, 1 policy stream beside\)", out)
        assert 0 < p50 <= p90 and n >= 2
        rate, replies = _num(rf"policy tokens/s, {place}: median {NUM} \({NUM} replies of 16 "
                             rf"tokens\)", out)
        assert rate > 0 and replies == 2
    # Two processes each hold the model and a Python + torch runtime: more than one does.
    assert memory["two engines", "idle"] > memory["one engine", "idle"]
    ratios = _num(rf"one engine / two engines: judge p50 {NUM}x  p90 {NUM}x  policy tokens/s "
                  rf"{NUM}x \(medians of per-round ratios\)  memory after traffic RSS {NUM}x  "
                  rf"PSS {NUM}x", out)
    assert min(ratios) > 0 and ratios[3] < 1
    same, total = _num(rf"judge answers alike in both placements: {NUM} of {NUM}", out)
    assert total >= 2 and same <= total
    p50 = _num(rf"judge alone, judge engine: p50 {NUM} ms \(2 turns, no policy traffic\)",
               out)[0]
    assert p50 > 0
    for name in ("one engine's judge adapter", "the adapter with SmolLM2's template"):
        p50, same, n, verdicts, n2 = _num(
            rf"judge alone, {name}: p50 {NUM} ms \(2 turns, no policy traffic\); answers alike "
            rf"the judge engine's {NUM} of {NUM}, verdicts {NUM} of {NUM}", out)
        assert p50 > 0 and n == n2 == 2 and same <= n and verdicts <= n
    assert "load average at the start: " in out and out.count("machine: ") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--streams", "0"], "--streams must be at least 1"),
    (["--alone", "0"], "--alone must be at least 1"),
    (["--policy-threads", "-1"], "--policy-threads must be 0"),
    (["--base", "/nonexistent"], "is not a model directory"),
    (["--judge-adapter", "/nonexistent"], "is not a LoRA adapter"),
    (["--rounds", "x"], "invalid int value"),
])
def test_bench_placement_bad_arguments_are_one_line(
        args: list[str], message: str, tiny_model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = [] if "--base" in args else ["--base", str(tiny_model_dir)]
    err = one_line_exit(main, [*base, *args], capsys)
    assert err.startswith("clawrl bench placement: ") and message in err, err
