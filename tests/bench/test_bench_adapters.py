"""`clawrl bench adapters` runs for real on the CI-sized tiny world model and prints every
figure; bad arguments and an engine that cannot start are one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from oneline import one_line_exit

from clawrl.bench.adapters import main

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "clawrl" / "world" / "prebuilt" / "tinyworld-ci"
NUM = r"([\d,]+\.?\d*)"


def _num(pattern: str, text: str) -> list[float]:
    found = re.search(pattern, text)
    assert found, f"no line matches {pattern!r} in:\n{text}"
    return [float(g.replace(",", "")) for g in found.groups()]


def test_bench_adapters_prints_every_figure() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "bench", "adapters", "--model", str(MODEL),
         "--quick", "--adapters", "1,3", "--rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert _num(rf"base model alone: {NUM} \(4 requests x 8 tokens", out)[0] > 0
    for count in ("1 adapter", "3 adapters"):
        mixed, base, ratio, alone = _num(
            rf"tokens/s, {count} resident: {NUM} with requests round robin over them, base "
            rf"requests {NUM}: ratio {NUM} to base \(base alone {NUM}\)", out)
        assert min(mixed, base, ratio, alone) > 0
    per_adapter, grown, tensors, file = _num(
        rf"memory per resident adapter: {NUM} MB engine RSS \(3 loaded: \+{NUM} MB\); "
        rf"tensors {NUM} MB, safetensors file {NUM} MB", out)
    assert per_adapter > 0 and grown > 0
    # rank 16 on q,k,v,o,gate,up,down of the 4-layer, 128-wide model: 180,224 float32 values
    assert tensors == pytest.approx(180_224 * 4 / 2**20, abs=1e-3) and file >= tensors
    for side, load in (("adapter \\(3 resident\\)", "load"),
                       ("shared-model adapter version", "load"), ("full weights", "update")):
        figures = _num(rf"publish to serving, {side}: save {NUM} ms  {load} {NUM} ms  first "
                       rf"request {NUM} ms  end to end {NUM} ms  pause {NUM} ms", out)
        assert figures[3] > 0 and figures[3] >= figures[1] and figures[4] >= 0
    assert re.search(r"full weights / adapter: end to end [\d.]+x, pause ", out), out
    assert re.search(r"full weights / shared-model adapter version: end to end [\d.]+x, "
                     r"pause ", out), out


@pytest.mark.parametrize(("args", "message"), [
    (["--adapters", "1,x"], "--adapters takes positive integers separated by commas"),
    (["--adapters", "0"], "--adapters takes positive integers separated by commas"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--model", "/nonexistent"], "--model /nonexistent is not a model directory"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_bad_arguments_are_one_line(args: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_exit(main, args, capsys)
    assert err.startswith(f"clawrl bench adapters: {message}"), err


def test_an_engine_that_cannot_start_is_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for part in MODEL.iterdir():  # everything but the weights
        if part.name != "model.safetensors":
            shutil.copy(part, tmp_path)
    assert main(["--model", str(tmp_path), "--quick"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("clawrl bench adapters: the engine exited (code 1): clawrl engine: "
                          f"cannot load {tmp_path}: "), err
