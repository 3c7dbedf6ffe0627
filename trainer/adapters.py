"""The engine's side of LoRA adapters, for every trainer that publishes one: load, unload and
list adapters over SGLang's routes (`/load_lora_adapter`, `/unload_lora_adapter`, the
adapters `/v1/models` lists with a `parent`).

Personal mode (trainer/personal.py) publishes one adapter per user, shared-model LoRA
(trainer/policy_adapter.py) one adapter per version of the model everyone is served; both
speak to the engine through these calls only, so they fail and retry alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawrl.base.engine_client import absent_adapter, sync_client
from clawrl.base.settings import EngineSettings


class AdapterPublishError(Exception):
    """The engine did not load (or unload) an adapter; whoever was served keeps what they had."""


def call_lora_route(engine: EngineSettings, route: str, body: dict[str, Any],
                    timeout_s: float = 120.0) -> dict[str, Any]:
    """POST a LoRA route; AdapterPublishError unless the engine answers `success: true`."""
    with sync_client(engine, timeout_s) as client:
        resp = client.post(route, json=body)
    try:
        answer: dict[str, Any] = resp.json()
    except ValueError:
        answer = {"error_message": resp.text[:200]}
    if resp.status_code != 200 or not answer.get("success", False):
        raise AdapterPublishError(f"{route} {body.get('lora_name')}: HTTP {resp.status_code} "
                                  f"{answer.get('error_message') or answer}")
    return answer


def load_adapter(engine: EngineSettings, name: str, path: Path) -> None:
    call_lora_route(engine, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload_adapter(engine: EngineSettings, name: str) -> bool:
    """Unload `name`; False when the engine does not have it (nothing to do)."""
    try:
        call_lora_route(engine, "/unload_lora_adapter", {"lora_name": name})
    except AdapterPublishError as exc:
        if absent_adapter(str(exc)):
            return False
        raise
    return True


def engine_adapters(engine: EngineSettings) -> set[str]:
    """The adapters the engine lists (SGLang and `clawrl engine`: `/v1/models` entries with
    a `parent`)."""
    with sync_client(engine, 10.0) as client:
        resp = client.get("/v1/models")
        resp.raise_for_status()
    return {m["id"] for m in resp.json().get("data", []) if m.get("parent")}
