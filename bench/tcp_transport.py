"""Throughput of the TCP transport against a bare loopback socket, in the same run.

Both sides move the same source bytes over 127.0.0.1 and time the same thing: from
the first byte written to the receiver's 1-byte acknowledgement of the whole payload.

* raw:  a plain blocking socket pair; ``sendall`` of a memoryview, ``recv_into`` into a
        preallocated buffer in a loop, then a 1-byte ack.
* ours: `TcpSender.send_blocking` into a `TcpReceiver` that receives into a fresh
        `BufferPool` lease each time (registration with `expect` is outside the timing,
        as on a decode worker it happens before Ready).

Raw and ours alternate within each repeat, so both see the same machine noise; the
table reports medians. Usage::

    python bench/tcp_transport.py [--sizes-mib 1 16 256] [--repeats 9] [--json PATH]
                                  [--socket-buffer-kib N]

On loopback, fixed small socket buffers (256 KiB-1 MiB) often beat the kernel's
autotuning for both sides, because the bytes in flight stay in the CPU cache; across
hosts they cap throughput at buffer / RTT, so the transport keeps autotuning by default
and `--socket-buffer-kib` shows the effect on both paths alike.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.pool import BufferPool
from workers.transports.tcp import TcpConfig, TcpReceiver, TcpSender, byte_view

MiB = 1 << 20


class RawPair:
    """A bare loopback connection whose server thread receives `n` bytes per round, then acks."""

    def __init__(self, dst: memoryview, socket_buffer: int | None = None) -> None:
        self.dst = dst
        self.listener = socket.create_server(("127.0.0.1", 0))
        if socket_buffer:  # inherited by the accepted socket
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer)
        self.rounds: list[int] = []
        self.go = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._serve, name="raw-rx", daemon=True)
        self.thread.start()
        self.client = socket.create_connection(self.listener.getsockname()[:2])
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if socket_buffer:
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer)

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                self.go.acquire()
                if not self.rounds:
                    return
                n = self.rounds.pop()
                got = 0
                while got < n:
                    k = conn.recv_into(self.dst[got:n], n - got)
                    if k == 0:
                        return
                    got += k
                conn.sendall(b"\x06")

    def send(self, src: memoryview) -> float:
        self.rounds.append(len(src))
        self.go.release()
        t0 = time.perf_counter()
        self.client.sendall(src)
        if self.client.recv(1) != b"\x06":
            raise RuntimeError("raw receiver did not acknowledge")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.go.release()  # no rounds queued: the server thread returns
        self.client.close()
        self.thread.join(5)
        self.listener.close()


def bench(sizes: list[int], repeats: int, socket_buffer: int | None = None) -> list[dict[str, float]]:
    biggest = max(sizes)
    src_all = torch.randint(0, 256, (biggest,), dtype=torch.uint8)
    raw_dst = torch.zeros(biggest, dtype=torch.uint8)
    pool = BufferPool(-(-biggest // 4096) * 4096, alignment=4096)
    pool.tensor.zero_()  # touch every page once, as raw_dst was
    rows = []
    config = TcpConfig(socket_buffer=socket_buffer)
    with TcpReceiver(config=config) as rx, TcpSender(config) as tx:
        raw = RawPair(byte_view(raw_dst, writable=True), socket_buffer)
        try:
            for n in sizes:
                src = byte_view(src_all[:n], writable=False)
                raw_t, ours_t = [], []
                for i in range(repeats + 1):  # the first round warms both paths up
                    r = raw.send(src)
                    lease = pool.acquire_nowait(n)
                    done = rx.expect(f"bench-{n}-{i}", 0, lease.tensor, n)
                    t0 = time.perf_counter()
                    tx.send_blocking(rx.endpoint, f"bench-{n}-{i}", 0, src)
                    o = time.perf_counter() - t0
                    done.wait_blocking(10)
                    if i == 0 and not torch.equal(lease.tensor, src_all[:n]):
                        raise AssertionError(f"{n} bytes arrived altered")
                    lease.release()
                    if i:
                        raw_t.append(r)
                        ours_t.append(o)
                raw_gbs = n / statistics.median(raw_t) / 1e9
                ours_gbs = n / statistics.median(ours_t) / 1e9
                rows.append(
                    {
                        "size_mib": n / MiB,
                        "raw_gbs": round(raw_gbs, 3),
                        "ours_gbs": round(ours_gbs, 3),
                        "ratio": round(ours_gbs / raw_gbs, 3),
                        "repeats": repeats,
                    }
                )
        finally:
            raw.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds per size (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--socket-buffer-kib", type=int, default=None, help="fixed SO_SNDBUF/SO_RCVBUF for both sides (default: kernel autotuning)"
    )
    args = parser.parse_args()
    sizes = [int(s * MiB) for s in args.sizes_mib]
    buf = args.socket_buffer_kib * 1024 if args.socket_buffer_kib else None
    rows = bench(sizes, args.repeats, buf)
    print(f"{'size':>9}  {'raw GB/s':>9}  {'ours GB/s':>9}  {'ratio':>6}")
    for r in rows:
        print(f"{r['size_mib']:>6g} MiB  {r['raw_gbs']:>9.2f}  {r['ours_gbs']:>9.2f}  {r['ratio']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"benchmark": "tcp_transport", "socket_buffer": buf or "autotuned", "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
