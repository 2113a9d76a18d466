"""The health probe the demo and the end-to-end tests poll while vLLM servers start,
how a server's port is told to be its own, and how an engine gives way to the broker."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from demo import servers
from demo.servers import ServerError, ServerProcess, free_port, http_status, listens, wait_all_healthy, yielding
from tests.support import wait_until


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


needs_proc = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc")

# A stand-in for a vLLM server, in a process of its own: like vLLM it takes its time
# before it listens (until the FIFO argv[2] is opened for writing and closed), then
# answers /health on argv[1].
STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
with open(sys.argv[2]) as go:
    go.read()
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _StandIn(ServerProcess):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, log_dir, "stand-in")
        self.go = log_dir / "go"
        os.mkfifo(self.go)

    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(self.port), str(self.go)]

    def let_listen(self) -> None:
        """Let the running stand-in go on to listen: open its FIFO for writing, which
        needs the stand-in there reading it, and close it."""

        def opened() -> list[int] | None:
            try:
                return [os.open(self.go, os.O_WRONLY | os.O_NONBLOCK)]
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no reader yet
                    return None
                raise

        os.close(wait_until(opened, 30, "the stand-in to wait on its FIFO")[0])


@pytest.fixture
def impostor() -> Iterator[int]:
    """Another program's HTTP server, answering /health 200: its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@needs_proc
def test_listens_tells_whether_a_process_holds_the_socket_listening_on_a_port() -> None:
    mine, bound = socket.socket(), socket.socket()
    mine.bind(("127.0.0.1", 0))
    mine.listen()
    bound.bind(("127.0.0.1", 0))  # bound, not listening: as vLLM holds its port at first
    child = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
         "print(s.getsockname()[1], flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        theirs = int(child.stdout.readline())
        assert listens(os.getpid(), mine.getsockname()[1]) is True
        assert listens(os.getpid(), bound.getsockname()[1]) is False
        assert listens(child.pid, theirs) is True
        assert listens(os.getpid(), theirs) is False
    finally:
        assert child.stdin is not None
        child.stdin.close()  # it ends on its own
        child.wait(timeout=30)
        mine.close()
        bound.close()


@needs_proc
def test_a_server_whose_port_another_program_answers_on_starts_again_on_another(
    tmp_path: Path, impostor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handed a port that another program then listened on, a server would never listen
    itself, and its /health and requests would reach that program: the probe sees the
    200 come from a socket the server does not hold, and starts it again on another port."""
    real = servers.free_port
    ports = iter([impostor])
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())
    stand_in = _StandIn(tmp_path)
    stand_in.start()
    try:
        assert stand_in.port == impostor
        assert http_status(impostor, "/health") == 200  # what the probe alone took for healthy
        assert stand_in.healthy() is False
        assert stand_in.port != impostor and stand_in.port_retries == 1
        stand_in.let_listen()
        server = wait_all_healthy([stand_in], timeout=30)["stand-in"]
        assert server.port == stand_in.port and listens(server.pid, server.port) is True
    finally:
        stand_in.stop()


@needs_proc
def test_a_server_that_finds_another_program_on_every_port_it_is_given_fails_saying_so(
    tmp_path: Path, impostor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(servers, "free_port", lambda: impostor)
    stand_in = _StandIn(tmp_path)
    stand_in.start()
    try:
        for _ in range(servers.PORT_RETRIES):
            assert stand_in.healthy() is False
        with pytest.raises(ServerError, match=f"another program answered on each of the 3 ports it was given "
                                              f"\\(the last {impostor}\\)"):
            stand_in.healthy()
    finally:
        stand_in.stop()


def test_an_engines_command_runs_as_the_same_process_with_its_session_and_itself_at_nice_10() -> None:
    probe = ("import os; g = '/proc/self/autogroup'; "
             "print(os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), open(g).read().split()[-1] if os.path.exists(g) else '-')")
    child = subprocess.Popen(yielding([sys.executable, "-c", probe]), stdout=subprocess.PIPE, text=True,
                             start_new_session=True)  # a session of its own, as every engine here
    out, _ = child.communicate(timeout=30)
    pid, nice, session_nice = out.split()
    # The same PID: the engine is stopped by it, and its process group is led by it.
    assert (int(pid), int(nice), child.returncode) == (child.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10), 0)
    assert session_nice in ("10", "-")  # "-": a kernel without autogroups
