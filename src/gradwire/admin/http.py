"""The admin HTTP endpoint of one node: a handler per path, served by a daemon thread.

Bound to 127.0.0.1 unless GRADWIRE_ADMIN_HOST says otherwise; port 0 lets the kernel pick (GRADWIRE_ADMIN_PORT),
-1 turns it off. Handlers return (status, content type, body).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("gradwire.admin")

Handler = Callable[[], tuple[int, str, bytes]]


def json_handler(fn: Callable[[], object]) -> Handler:
    """A handler that serves fn()'s result as JSON."""
    return lambda: (200, "application/json", json.dumps(fn(), indent=1, default=str).encode())


class AdminServer:
    """Serves `routes` on host:port until `stop`. Thread-safe: handlers run on the server's threads."""

    def __init__(self, host: str, port: int, routes: dict[str, Handler]) -> None:
        self.routes = {"/healthz": lambda: (200, "text/plain", b"ok\n")} | routes
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                route = outer.routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype, body = 404, "text/plain", f"no such path; try {sorted(outer.routes)}\n".encode()
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as e:  # noqa: BLE001 - a broken handler is a 500, never a dead endpoint
                        log.exception("admin handler %s", self.path)
                        status, ctype, body = 500, "text/plain", f"{type(e).__name__}: {e}\n".encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("admin %s", format % args)

        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gw-admin", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop serving, at once: serve_forever looks for a shutdown only between two waits of half a second, so a
        connection to the listening socket (this node's own) wakes it until it has seen it."""
        stopper = threading.Thread(target=self._httpd.shutdown, name="gw-admin-stop", daemon=True)
        stopper.start()
        while stopper.is_alive():
            self._wake()
            stopper.join(0.05)
        self._httpd.server_close()

    def _wake(self) -> None:
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        try:
            socket.create_connection((host, self.port), timeout=0.2).close()
        except OSError:
            pass  # not listening any more, or not reachable from here: the wait ends within half a second anyway
