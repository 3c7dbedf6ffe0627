"""`clawrl bench proxy` runs end to end (a tiny configuration; no figure is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADMIN_URL = os.environ.get("CLAWRL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def test_bench_proxy_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWRL_")}
    env["CLAWRL_DATABASE__URL"] = ADMIN_URL  # the bench makes (and drops) a scratch database
    done = subprocess.run(
        [sys.executable, "-m", "clawrl.cli.main", "bench", "proxy", "--clients", "1,3",
         "--single", "5", "--per-client", "1", "--reply-s", "0.05", "--chunk-ms", "10",
         "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turns lost 0" in done.stdout
    result = json.loads(out.read_text())
    assert [(r["clients"], r["mode"]) for r in result["rows"]] == [
        (1, "nonstream"), (1, "stream"), (3, "nonstream"), (3, "stream")]
    assert all(r["errors"] == 0 for r in result["rows"])
    assert result["served"] == result["rows_in_db"] > 0
