"""``grpax serve``: an OpenAI-compatible server on the rollout engine (``grpax.serve.app``), with token ids,
per-token logprobs and the policy version of each response for agent harnesses and evaluation suites.

``start`` runs the app on uvicorn in a background thread (tests, or a trainer that serves its current policy
in-process and swaps weights with ``EngineWorker.update_params``); ``grpax serve`` runs it in the foreground.
Needs the ``serve`` extra (``pip install 'grpax[serve]'``: fastapi, uvicorn).
"""

from __future__ import annotations

import threading
import time


class Running:
    """A server started by ``start``: its base URL (``.../v1``) and ``stop``."""

    def __init__(self, uvicorn_server, thread: threading.Thread, worker, url: str):
        self._server, self._thread, self.worker, self.url = uvicorn_server, thread, worker, url

    def stop(self, stop_worker: bool = True) -> None:
        """Stops the HTTP server, then (``stop_worker``) the engine loop."""
        self._server.should_exit = True
        self._thread.join()
        if stop_worker:
            self.worker.stop()


def start(server, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0) -> Running:
    """Serves ``server`` (a ``grpax.serve.app.Server``) on ``host:port`` from a background thread (port 0: a
    free one) and returns once it accepts connections.

    Raises:
      RuntimeError: uvicorn did not start within ``timeout`` seconds (the port taken, ...).
    """
    import socket

    import uvicorn

    from grpax.serve.app import build_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(build_app(server), log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="grpax-serve-http", daemon=True)
    server.worker.start()
    thread.start()
    deadline = time.monotonic() + timeout
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.worker.stop()
            raise RuntimeError(f"grpax serve did not start on {host}:{port}")
        time.sleep(0.02)
    return Running(uv, thread, server.worker, f"http://{host}:{sock.getsockname()[1]}/v1")
