"""A graceful stop that no keep-alive client can race: uvicorn's HTTP protocol, except how a
connection ends once SIGTERM has arrived.

uvicorn's own graceful shutdown closes an idle keep-alive connection at once, and one with a
response in flight right after that response. When the response's headers went out before
the SIGTERM (every stream in flight), they promised keep-alive; the client, having read
`[DONE]`, sends its next request on that connection at the moment the server closes it, and
gets an EOF or a reset without an answer (`clawrl bench faults`: 32 of 32 streaming clients
failed that way). Here such a connection stays open for up to `LINGER_S` after its last
response: a request that arrives meanwhile is served in full with `Connection: close`, and
only then is the connection closed. Responses not yet started say `Connection: close`
anyway (uvicorn), so their clients never reuse the connection.

    uvicorn.run(app, http=DrainingHttpTools, ...)
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# How long a connection that promised keep-alive waits for the request its client may already
# be sending. Bounds how much the stop is delayed after the last response.
LINGER_S = 1.0


class DrainingHttpTools(HttpToolsProtocol):
    """HttpToolsProtocol whose graceful shutdown lets a request already on its way in."""

    draining = False

    def shutdown(self) -> None:
        self.draining = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.response_started:
            cycle.keep_alive = False  # its headers will say Connection: close
            return
        if cycle is None or cycle.response_complete:
            self._linger()  # idle, but the client may be sending right now
        # Else the headers (keep-alive) are out: the response finishes, then we linger.

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.draining and self.cycle is not None:
            self.cycle.keep_alive = False  # served, then closed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.draining and not self.transport.is_closing() and not self.pipeline:
            self._linger()

    def _linger(self) -> None:
        """Close after LINGER_S unless a request arrives (its response then closes it)."""
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
        self.timeout_keep_alive_task = self.loop.call_later(
            LINGER_S, self.timeout_keep_alive_handler)
