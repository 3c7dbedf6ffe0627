"""Publishing against engine faults injected with httpx.MockTransport (trainer/publish.py).

The happy path against the real embedded engine is in test_train_loop.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from clawrl.base.settings import EngineSettings
from trainer.export import CheckpointError, write_version
from trainer.publish import PublishError, publish_version

ENGINE = EngineSettings(url="http://engine.test")


def make_version(weights_dir: Path, n: int, base: Path) -> Path:
    def write(out: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))
        (out / "config.json").write_text("{}")

    base.mkdir(exist_ok=True)
    (base / "tokenizer.json").write_text("{}")
    return write_version(weights_dir, n, write, base)


class FakeEngine:
    """Answers like SGLang; `plan` is the sequence of update outcomes to play."""

    def __init__(self, plan: list[str]) -> None:
        self.plan, self.version, self.posts = list(plan), "default", []  # type: ignore[var-annotated]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.version})
        body = json.loads(request.content)
        self.posts.append(body)
        outcome = self.plan.pop(0)
        if outcome == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if outcome == "refuse":
            return httpx.Response(400, json={"success": False, "message": "load failed"})
        if outcome == "lie":  # says success but keeps the old version
            return httpx.Response(200, json={"success": True, "message": "ok"})
        self.version = body["weight_version"]
        return httpx.Response(200, json={"success": True, "message": "ok"})


def test_publish_confirms_the_version_and_sends_the_absolute_path(tmp_path: Path) -> None:
    path = make_version(tmp_path / "w", 4, tmp_path / "base")
    fake = FakeEngine(["ok"])
    info = publish_version(ENGINE, path, 4, transport=httpx.MockTransport(fake))
    assert info["weight_version"] == "4"
    assert fake.posts == [{"model_path": str(path.resolve()), "weight_version": "4"}]


def test_transient_failures_are_retried(tmp_path: Path) -> None:
    path = make_version(tmp_path / "w", 1, tmp_path / "base")
    fake = FakeEngine(["down", "refuse", "ok"])
    info = publish_version(ENGINE, path, 1, attempts=3, backoff_s=0,
                           transport=httpx.MockTransport(fake))
    assert info["weight_version"] == "1" and len(fake.posts) == 3


@pytest.mark.parametrize("outcome", ["refuse", "lie", "down"])
def test_giving_up_leaves_the_old_version_serving(tmp_path: Path, outcome: str) -> None:
    path = make_version(tmp_path / "w", 2, tmp_path / "base")
    fake = FakeEngine([outcome] * 3)
    with pytest.raises(PublishError, match="after 3 attempts"):
        publish_version(ENGINE, path, 2, attempts=3, backoff_s=0,
                        transport=httpx.MockTransport(fake))
    assert fake.version == "default" and len(fake.posts) == 3


def test_missing_or_corrupt_folder_is_refused_before_the_engine_is_asked(
        tmp_path: Path) -> None:
    fake = FakeEngine(["ok"])
    with pytest.raises(CheckpointError, match="does not exist"):
        publish_version(ENGINE, tmp_path / "w" / "v000007", 7,
                        transport=httpx.MockTransport(fake))
    path = make_version(tmp_path / "w", 8, tmp_path / "base")
    (path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="corrupt"):
        publish_version(ENGINE, path, 8, transport=httpx.MockTransport(fake))
    assert fake.posts == []
