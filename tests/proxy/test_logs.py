"""Logs a user reads are quiet: library request lines only at DEBUG (clawrl/base/logs.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A real HTTP server and a real httpx request, in a fresh interpreter configured the way a
# clawrl process configures itself.
CODE = """
import http.server, logging, sys, threading
import httpx
from clawrl.base.logs import setup_logging
setup_logging(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
httpx.get(f"http://127.0.0.1:{server.server_port}/model_info")
logging.getLogger("clawrl.proxy").info("a line for the user")
server.shutdown()
"""


@pytest.mark.parametrize(("level", "request_lines"), [("info", 0), ("debug", 1)])
def test_httpx_request_lines_only_at_debug(level: str, request_lines: int) -> None:
    out = subprocess.run([sys.executable, "-c", CODE, level], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "a line for the user" in out.stderr
    assert out.stderr.count("HTTP Request: GET") == request_lines, out.stderr
