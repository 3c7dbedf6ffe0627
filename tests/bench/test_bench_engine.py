"""`clawrl bench engine` runs end to end on the tiny model and reports a real cache hit (its
figures are only printed, never asserted: speed is measured by the bench, not by tests); bad
arguments are one line; without llama.cpp installed the anchor says in one line how to install
it; the anchor's float32 GGUF holds the quantized file's weights dequantized."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from oneline import one_line_exit

from clawrl.bench import engine as bench
from clawrl.bench.engine import f32_gguf, install_hint, main, start_anchor

TINY_ARGS = ["--reps", "1", "--prefix-tokens", "128", "--suffix-tokens", "8", "--new-tokens",
             "4"]


def test_bench_engine_prints_every_figure(tiny_model_dir: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tiny_model_dir), *TINY_ARGS, "--no-anchor"]) == 0
    out = capsys.readouterr().out
    assert "decode, 1 concurrent:" in out and "decode, 8 concurrent:" in out
    assert "(128 tokens cached)" in out and "cache off:" in out
    assert "decode ceiling" in out and "llama.cpp" not in out


def test_the_anchor_needs_smollm2(tiny_model_dir: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Any other model runs without the anchor, saying why in one line (and never fails)."""
    assert main(["--model", str(tiny_model_dir), *TINY_ARGS]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "anchor" in line]
    assert lines[0] == (f"anchor: no llama.cpp figures: {tiny_model_dir} is not smollm2-135m "
                        "as `clawrl models pull` writes it (the anchor runs that model's GGUF "
                        "file); --no-anchor skips it")


def test_missing_llama_cpp_is_one_line_on_how_to_install_it(tmp_path: Path) -> None:
    assert start_anchor("/nonexistent/python", 1, [tmp_path / "m.gguf"]) == install_hint(
        "/nonexistent/python")
    if importlib.util.find_spec("cyllama") is None:  # this python has no llama.cpp
        assert start_anchor(sys.executable, 1, []) == install_hint(sys.executable)
    hint = install_hint("/usr/bin/python3")
    assert "\n" not in hint and "pip install cyllama==" in hint and "--anchor-python" in hint


@pytest.mark.parametrize(("args", "message"), [
    (["--threads", "0"], "--threads must be at least 1"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["--prefix-tokens", "0"], "--prefix-tokens must be at least 1"),
    (["--prefix-cache-mb", "0"], "--prefix-cache-mb must be positive"),
    (["--prefix-tokens", "8192"], "--prefix-tokens + --suffix-tokens is at most 8192 with the "
                                  "anchor"),
    (["--model", "/nonexistent"], "--model /nonexistent is not a model directory"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_bad_arguments_are_one_line(args: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_exit(main, args, capsys)
    assert err.startswith(f"clawrl bench engine: {message}"), err


def test_f32_gguf_dequantizes_every_tensor_and_keeps_the_metadata(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    weights = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    norm = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    src = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_block_count(2)
    writer.add_token_list(["a", "b", "c"])
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_1))
    writer.add_tensor("blk.0.attn_q.weight",
                      gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = f32_gguf(src, tmp_path / "cache" / "f32.gguf")
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(out)
    assert after.fields["llama.block_count"].contents() == 2
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert after.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert new.name == old.name and new.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(new.shape) == list(old.shape)
        expected = gguf.quants.dequantize(old.data, old.tensor_type)
        assert np.array_equal(np.asarray(new.data).reshape(expected.shape), expected)
    assert np.abs(np.asarray(after.tensors[0].data) - weights).max() < 0.3  # 4-bit steps
    mtime = out.stat().st_mtime_ns
    assert f32_gguf(src, out) == out and out.stat().st_mtime_ns == mtime  # written once
    assert [p.name for p in out.parent.iterdir()] == ["f32.gguf"]  # no temporary left


ANCHOR_PYTHON = os.environ.get("CLAWRL_ANCHOR_PYTHON")


@pytest.mark.skipif(not ANCHOR_PYTHON, reason="CLAWRL_ANCHOR_PYTHON: a python with cyllama")
def test_llama_anchor_decodes_greedily_in_batches() -> None:
    """The llama.cpp driver on the shipped SmolLM2 file: a batch of two sequences decodes as
    each alone (greedy), and the prefill answers (opt-in: needs llama.cpp installed)."""
    assert ANCHOR_PYTHON is not None
    try:
        path = bench.gguf_path("smollm2-135m")
    except Exception as exc:
        pytest.skip(str(exc))
    prompts = [[1, 504, 3458, 314, 253, 1701], [1, 19556, 28, 638]]
    requests = [{"model": 0, "prompts": prompts, "new": 6},
                {"model": 0, "prompts": prompts[:1], "new": 6},
                {"model": 0, "prompts": prompts[1:], "new": 6},
                {"model": 0, "prefill": list(range(100, 700))}]
    done = subprocess.run([ANCHOR_PYTHON, str(bench.ANCHOR_SCRIPT), "1", str(path)],
                          input="".join(json.dumps(r) + "\n" for r in requests),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ready, both, first, second, prefill = map(json.loads, done.stdout.splitlines())
    assert ready["ready"].startswith("b")
    assert both["tokens"] == 10 and both["seconds"] > 0
    assert both["outputs"] == first["outputs"] + second["outputs"]
    assert prefill["seconds"] > 0
