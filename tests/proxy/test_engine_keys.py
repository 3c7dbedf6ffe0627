"""The embedded engine's keys, as SGLang's `--api-key` / `--admin-api-key`: control routes
(weights, LoRA adapters, pause, abort, cache) need a key whenever one is set; health checks never do.

`clawrl up` sets `CLAWRL_ENGINE__API_KEY` for the engine and every client of it; that path
is covered end to end in test_stack.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from clawrl.engine.server import CONTROL_ROUTES

# One harmless request per control route (no route changes what is served for long).
CONTROL = [("POST", "/flush_cache", None),
           ("POST", "/pause_generation", {"mode": "abort"}),
           ("POST", "/continue_generation", {}),
           ("POST", "/abort_request", {"rid": "nothing", "abort_all": False}),
           ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
           ("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
           ("POST", "/unload_lora_adapter", {"lora_name": "x"}),
           ("POST", "/update_weights_from_disk", {"model_path": ""})]
GENERATE = ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})


def call(url: str, route: tuple[str, str, object], key: str | None) -> int:
    method, path, body = route
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, url + path, json=body, headers=headers,
                         timeout=60).status_code


def test_every_control_route_is_listed() -> None:
    assert {path for _, path, _ in CONTROL} == CONTROL_ROUTES


def test_api_key_guards_control_and_data_routes(
        engine_factory: Callable[..., str], tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The key comes from CLAWRL_ENGINE__API_KEY, as `clawrl up` hands it over."""
    monkeypatch.setenv("CLAWRL_ENGINE__API_KEY", "ck-engine-secret")
    url = engine_factory(tiny_model_dir)
    for route in [*CONTROL, GENERATE]:
        assert call(url, route, None) == 401, route
        assert call(url, route, "wrong") == 401, route
    for route in [*CONTROL, GENERATE]:
        # 400 for the empty model_path: past the key check, refused by the route itself.
        assert call(url, route, "ck-engine-secret") in (200, 400), route
    assert call(url, CONTROL[-1], "ck-engine-secret") == 400
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/model_info").status_code == 401


def test_admin_key_guards_control_routes_only(
        engine_factory: Callable[..., str], tiny_model_dir: Path) -> None:
    url = engine_factory(tiny_model_dir, "--api-key", "data-key", "--admin-api-key", "admin-key")
    for route in CONTROL:
        assert call(url, route, None) == 401, route
        assert call(url, route, "data-key") == 401, route  # as SGLang: not the API key
        assert call(url, route, "admin-key") in (200, 400), route
    assert call(url, GENERATE, "data-key") == 200
    assert call(url, GENERATE, None) == 401


def test_without_keys_everything_is_open(engine_url: str) -> None:
    """The shared engine (conftest `engine_url`) is started without keys; flushing its cache
    changes nothing the other tests see."""
    assert call(engine_url, CONTROL[0], None) == 200
    assert call(engine_url, GENERATE, None) == 200
