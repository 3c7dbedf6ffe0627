"""The GUI track's web server: one small HTTP server per process, on 127.0.0.1 at a free port,
in a thread of its own, serving each episode's application at /app/<token> (a page that
embeds the app's spec and clawrl/envs/gui/app.js). Episodes register their spec on reset and
drop it on close; any other path is a 404.
"""

from __future__ import annotations

import html
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

APP_JS = Path(__file__).with_name("app.js").read_text()
CSS = """
body { font: 15px/1.4 sans-serif; margin: 0; padding: 12px 20px; color: #222; }
h1 { font-size: 22px; margin: 4px 0 12px; } h2 { font-size: 17px; margin: 8px 0; }
ul { list-style: none; padding: 0; margin: 0; } li { padding: 3px 0; }
.row { display: flex; align-items: center; gap: 10px; padding: 4px 0; }
.row label { min-width: 150px; } button { margin: 2px 6px; padding: 3px 10px; }
.switch[aria-checked=true] { background: #2a7; color: #fff; }
.dd, .menu { position: relative; display: inline-block; }
.pop { position: absolute; z-index: 5; background: #fff; border: 1px solid #888; min-width: 120px; }
.pop li, .pop button { display: block; padding: 3px 10px; cursor: pointer; }
header { display: flex; gap: 16px; align-items: center; border-bottom: 1px solid #ccc; }
nav { display: flex; gap: 10px; align-items: center; } [role=alert] { color: #b00; margin: 0 0 4px 160px; }
.layout-grid .grid { display: grid; grid-template-columns: 1fr 1fr; column-gap: 24px; }
.layout-wide { font-size: 17px; } .layout-wide .row { padding: 8px 0; } .layout-wide li { padding: 7px 0; }
.backdrop { position: fixed; inset: 0; background: rgba(0,0,0,.35); z-index: 10; }
.dialog { position: fixed; top: 120px; left: 180px; z-index: 11; background: #fff; padding: 16px; border-radius: 6px; }
"""


class _Handler(BaseHTTPRequestHandler):
    server: AppServer

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        spec = self.server.apps.get(self.path.removeprefix("/app/"))
        if spec is None:
            self.send_error(404)
            return
        data = json.dumps(spec).replace("<", "\\u003c")  # no `</script>` inside the script
        body = (f"<!doctype html><html><head><meta charset=utf-8><title>"
                f"{html.escape(spec['title'])}</title><style>{CSS}</style></head><body>"
                f"<div id=root></div><script>window.SPEC = {data};\n{APP_JS}</script>"
                "</body></html>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


class AppServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.apps: dict[str, dict[str, Any]] = {}
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def add(self, spec: dict[str, Any]) -> str:
        """Serve `spec`'s application; returns its URL."""
        token = secrets.token_urlsafe(12)
        self.apps[token] = spec
        return f"{self.url}/app/{token}"

    def drop(self, url: str) -> None:
        self.apps.pop(url.rpartition("/")[2], None)


_lock = threading.Lock()
_server: AppServer | None = None


def app_server() -> AppServer:
    """The process's server, started on first use."""
    global _server
    with _lock:
        if _server is None:
            _server = AppServer()
            threading.Thread(target=_server.serve_forever, name="clawrl-gui-apps",
                             daemon=True).start()
        return _server
