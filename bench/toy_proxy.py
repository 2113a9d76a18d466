"""The peer for bench/gateway.py: vLLM's toy P/D proxy design, written here.

One FastAPI app under uvicorn and one pooled httpx.AsyncClient: each completion goes to
P (max_tokens 1, kv_transfer_params asking for a remote decode), the proxy waits for P's
answer, then streams D's answer back with P's kv_transfer_params (StreamingResponse over
`client.stream`). uvicorn's access log is off, so the proxy does no more than that.

    python bench/toy_proxy.py PORT_FILE PREFILL_URL DECODE_URL
"""

import os
import socket
import sys
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def app_for(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def decode_stream(body: dict):
        async with client.stream("POST", f"{decode}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                yield chunk

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        p_body = dict(body, max_tokens=1, stream=False,
                      kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        p = await client.post(f"{prefill}/v1/completions", json=p_body)
        p.raise_for_status()
        d_body = dict(body, kv_transfer_params=p.json().get("kv_transfer_params") or {})
        return StreamingResponse(decode_stream(d_body), media_type="application/json")

    return app


def main() -> None:
    port_file, prefill, decode = sys.argv[1:4]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    Path(f"{port_file}.tmp").write_text(str(sock.getsockname()[1]))
    os.replace(f"{port_file}.tmp", port_file)
    # As vLLM's toy proxy starts it (uvicorn.run: uvloop and httptools where installed).
    uvicorn.run(app_for(prefill, decode), fd=sock.fileno(), log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
