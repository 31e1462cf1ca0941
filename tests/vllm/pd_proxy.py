"""A disaggregation proxy as vLLM's own are built (its nixl integration tests' toy proxy, and routers made
the same way), written from the protocol, for the vLLM stage and bench/aiperf_pair.py:

1. the client's request goes to a prefill server with `kv_transfer_params: {"do_remote_decode": true, ...}`,
   `max_tokens: 1` (and `max_completion_tokens: 1` when sent), `stream: false`, no `stream_options`, and an
   `X-Request-Id`;
2. the prefill answer's `kv_transfer_params` go with the client's original request (its prompt or messages,
   its lengths, its stream flag) to a decode server, whose answer, streamed or whole, is the client's.

    python tests/vllm/pd_proxy.py --prefill URL [URL ...] --decode URL [URL ...] --port PORT

Servers of each pool are taken in turn. GET /health answers once the proxy listens.
"""
from __future__ import annotations

import argparse
import itertools
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def create_proxy(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    app = FastAPI()
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=TIMEOUT)

    async def relay(request: Request, path: str):
        body = await request.json()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        prefill_body = {**body, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                       "remote_engine_id": None, "remote_block_ids": None,
                                                       "remote_host": None, "remote_port": None},
                        "max_tokens": 1, "stream": False}
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body.pop("stream_options", None)
        prefilled = await client.post(f"{next(prefills)}{path}", json=prefill_body, headers=headers)
        if prefilled.status_code != 200:
            return JSONResponse(prefilled.json(), status_code=prefilled.status_code)
        decode_body = {**body, "kv_transfer_params": prefilled.json().get("kv_transfer_params")}
        decode_url = f"{next(decodes)}{path}"
        if not body.get("stream"):
            decoded = await client.post(decode_url, json=decode_body, headers=headers)
            return JSONResponse(decoded.json(), status_code=decoded.status_code)

        async def stream():
            async with client.stream("POST", decode_url, json=decode_body, headers=headers) as decoded:
                async for chunk in decoded.aiter_bytes():
                    yield chunk

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay(request, "/v1/chat/completions")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill servers' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode servers' base URLs")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_proxy(args.prefill, args.decode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
