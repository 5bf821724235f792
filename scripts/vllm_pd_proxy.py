"""A 1P1D proxy for two vLLM servers with the NixlConnector (what vLLM's examples' toy proxy does).

    scripts/vllm_pd_proxy.py --port P --prefill http://HOST:P1 --decode http://HOST:P2

A completion is first sent to the prefill server with `max_tokens` 1, no streaming and
`kv_transfer_params.do_remote_decode`; the prefill server's answer carries the parameters that
let the decode server pull the prompt's K/V (NIXL), and the request, with them, is then sent to the
decode server, whose stream is relayed as it comes. GET /health answers when both servers do;
GET /v1/models is the decode server's. Used by scripts/serve_vs_vllm.py.
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build_app(prefill: str, decode: str) -> Starlette:
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def completions(request: Request) -> Response:
        body = await request.json()
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        first.pop("stream_options", None)
        first.pop("min_tokens", None)
        answer = await client.post(f"{prefill}/v1/completions", json=first)
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        body["kv_transfer_params"] = answer.json().get("kv_transfer_params")
        upstream = client.build_request("POST", f"{decode}/v1/completions", json=body)
        reply = await client.send(upstream, stream=True)

        async def relay():
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        media = reply.headers.get("content-type", "application/json")
        return StreamingResponse(relay(), status_code=reply.status_code, media_type=media)

    async def health(request: Request) -> Response:
        for url in (prefill, decode):
            try:
                if (await client.get(f"{url}/health")).status_code != 200:
                    return JSONResponse({"status": "unhealthy"}, status_code=503)
            except httpx.HTTPError:
                return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        answer = await client.get(f"{decode}/v1/models")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", health), Route("/v1/models", models)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    args = p.parse_args()
    uvicorn.run(build_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
