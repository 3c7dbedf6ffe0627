"""`clawrl bench toolcalls` runs end to end on the tiny world's tool model (its template
renders tools, and it calls them often): the figures are printed, and the calls it counts
are the ones the engine's parser reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from clawrl.bench.toolcalls import main
from clawrl.engine.scheduler import SamplingParams, sampling_distribution
from clawrl.world.tools import SYSTEM, TOOLS

REPO = Path(__file__).resolve().parents[2]
TOOLS_MODEL = REPO / "clawrl" / "world" / "prebuilt" / "tinyworld-tools"


def test_bench_toolcalls_counts_the_calls_it_samples(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request = tmp_path / "agent.jsonl"
    request.write_text("\n" + json.dumps({"body": {"tools": TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "what is the favourite colour of jonas?"}]}}))
    template = tmp_path / "listed.txt"
    template.write_text("Tools: <tools>{tools}</tools>")
    assert main(["--model", str(TOOLS_MODEL), "--samples", "6", "--max-tokens", "96",
                 "--temperature", "1", "--no-builtin", "--request", f"{request}:2",
                 "--template", str(template)]) == 0
    out = capsys.readouterr().out
    assert "its template" in out and "{'temperature': 1.0}" in out
    lines = {m.group(1): m.group(0) for m in re.finditer(r"^agent:2 / (\w+): .*$", out, re.M)}
    assert set(lines) == {"engine", "listed"}
    engine = lines["engine"]
    assert re.search(r"P\(open\) [0-9.e-]+, first [0-9.e-]+, T=1 [0-9.e-]+; calls \d/6", engine)
    assert re.search(r"calls [1-6]/6 \(seeds [0-5]", engine), engine  # it calls its tool
    assert '"name": "lookup"' in out or '"name": "answer"' in out


def test_the_sampling_distribution_is_what_the_sampler_draws_from() -> None:
    """Temperature, top-k, top-p: every token outside the nucleus weighs exactly 0 (so a
    call whose first token lies there is never sampled, whatever the seed)."""
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -2.0])
    dist = sampling_distribution(logits, SamplingParams(temperature=0.5, top_p=0.9))
    assert dist[0] > dist[1] > 0 and float(dist[2:].sum()) == 0.0
    assert float(sampling_distribution(logits, SamplingParams(top_k=1))[1:].sum()) == 0.0
    hot = sampling_distribution(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(hot, torch.softmax(logits, -1))


def test_bench_toolcalls_measures_a_trained_adapter_version(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--adapter`: a LoRA version folder is merged into the model before it is measured, so
    the figures move with the adapter (a random one here); a folder that holds no adapter is
    refused."""
    from loras import make_adapter

    request = tmp_path / "agent.json"
    request.write_text(json.dumps({"tools": TOOLS, "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "what is the favourite colour of jonas?"}]}))
    args = ["--model", str(TOOLS_MODEL), "--samples", "2", "--max-tokens", "8",
            "--temperature", "1", "--no-builtin", "--request", str(request)]

    def figures(out: str) -> str:
        found = re.search(r"^agent / engine: .*?(P\(open\) \S+, first \S+, T=1 \S+);", out, re.M)
        assert found, out
        return found.group(1)

    assert main(args) == 0
    base = figures(capsys.readouterr().out)
    adapter = make_adapter(TOOLS_MODEL, tmp_path / "v000001", seed=0)
    assert main([*args, "--adapter", str(adapter)]) == 0
    out = capsys.readouterr().out
    assert f"+ {adapter}" in out.splitlines()[0] and figures(out) != base
    with pytest.raises(SystemExit, match="not a PEFT adapter"):
        main([*args, "--adapter", str(tmp_path)])
