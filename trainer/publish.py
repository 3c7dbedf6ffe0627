"""Hand a version folder to the serving engine and confirm it is being served.

    publish_version(engine, path, 7, attempts=5)  ->  the engine's /model_info after the swap

Protocol (SGLang and `clawrl engine` alike, see docs/engine-protocol.md): POST
`/update_weights_from_disk {"model_path", "weight_version": "7"}`; the engine drains in-flight
requests, loads the folder and swaps, or answers `success: false` and keeps serving the old
weights. Success is only believed when `GET /model_info` reports `weight_version == "7"`.
Folders are verified (completion marker, sizes, safetensors headers) before anything is
sent, so a missing or corrupt folder is refused here and the engine is never asked.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx

from clawrl.base.engine_client import sync_client
from clawrl.base.settings import EngineSettings
from trainer.export import verify_version

log = logging.getLogger("clawrl.trainer")


class PublishError(Exception):
    """The engine did not end up serving the version (it keeps serving the old one)."""


def serving_version(client: httpx.Client) -> str | None:
    info = client.get("/model_info")
    info.raise_for_status()
    version: str | None = info.json().get("weight_version")
    return version


def _try_once(client: httpx.Client, path: Path, label: str) -> dict[str, Any]:
    resp = client.post("/update_weights_from_disk",
                       json={"model_path": str(path.resolve()), "weight_version": label})
    try:
        body = resp.json()
    except ValueError:
        body = {"message": resp.text[:200]}
    if resp.status_code != 200 or not body.get("success", False):
        raise PublishError(f"engine refused the update (HTTP {resp.status_code}): "
                           f"{body.get('message') or body}")
    info = client.get("/model_info")
    info.raise_for_status()
    data: dict[str, Any] = info.json()
    if data.get("weight_version") != label:
        raise PublishError(f"engine reports weight_version {data.get('weight_version')!r} "
                           f"after loading {label!r}")
    return data


def publish_version(
    engine: EngineSettings,
    path: Path,
    version: int,
    *,
    attempts: int = 5,
    backoff_s: float = 1.0,
    timeout_s: float = 600.0,
    transport: httpx.BaseTransport | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Make the engine serve `path` as weight_version str(version); retry with backoff.

    Raises CheckpointError (folder missing/corrupt, nothing sent) or PublishError (every
    attempt failed; the engine still serves what it served before). `verify=False` skips
    the completion-marker check: for a plain model folder (the base model).
    """
    if verify:
        verify_version(path)
    label = str(version)
    last: Exception | None = None
    # `transport`: tests inject engine faults with httpx.MockTransport.
    with sync_client(engine, timeout_s, transport) as client:
        for attempt in range(1, attempts + 1):
            try:
                return _try_once(client, path, label)
            except (httpx.HTTPError, PublishError) as exc:
                last = exc
                log.warning("publish v%d attempt %d/%d failed: %s", version, attempt, attempts,
                            exc, extra={"action": "publish_retry"})
            if attempt < attempts:
                time.sleep(backoff_s * 2 ** (attempt - 1))
    raise PublishError(f"could not publish v{version} after {attempts} attempts: {last}") \
        from last
