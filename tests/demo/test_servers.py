"""The health probe the demo and the end-to-end tests poll while vLLM servers start."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from demo.servers import free_port, http_status


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_an_http_server_answers_its_status() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert http_status(port, "/health") == 200
        assert http_status(port, "/other") == 404
    finally:
        server.shutdown()
        server.server_close()


def test_another_programs_port_and_a_closed_port_answer_no_status() -> None:
    """A free port picked for a server can be taken by another program first (a vLLM
    server's internal socket did so): what it sends back is not HTTP, and the probe says
    'not healthy' rather than fail the start."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_binary() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x01\x7f\n")

    thread = threading.Thread(target=answer_binary, daemon=True)
    thread.start()
    try:
        assert http_status(listener.getsockname()[1], "/health", timeout=10) is None
    finally:
        thread.join(timeout=10)
        listener.close()
    assert http_status(free_port(), "/health") is None
