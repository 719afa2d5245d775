"""How much CPU does `kimi-service bench`'s client spend per streamed chunk, beside an aiohttp client?

A benchmark client that shares the machine with the server takes CPU from it. This measures the client
alone: a local server (a separate process) streams chat-completion chunks as fast as it can, and each
client reads the same number of streams; the table gives CPU milliseconds per 1,000 chunks and the ratio
to aiohttp (the client `vllm bench serve` uses). Run it with the runtime venv's Python (it has aiohttp):

    /opt/kimi-service/venv/bin/python scripts/bench_client_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time

import aiohttp
import httpx

from kimi_service.bench import send_request

CHUNK = "data: " + json.dumps({
    "id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "m",
    "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}],
}) + "\n\n"
USAGE = "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 0, "prompt_tokens": 1}}) + "\n\n"


def serve(port: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        count = (await request.json())["max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(count):
            await response.write(CHUNK.encode())
            if index % 8 == 0:
                await asyncio.sleep(0)
        await response.write((USAGE + "data: [DONE]\n\n").encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def ours(url: str, body: dict, concurrency: int, streams: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker() -> None:
            for _ in range(streams // concurrency):
                result = await send_request(client, "/v1/chat/completions", body)
                assert result.ok, result.error
        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def theirs(url: str, body: dict, concurrency: int, streams: int) -> None:
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            for _ in range(streams // concurrency):
                async with session.post("/v1/chat/completions", json=body) as response:
                    async for raw in response.content:
                        line = raw.decode().strip()
                        if line.startswith("data:") and line[5:].strip() != "[DONE]":
                            json.loads(line[5:])
        await asyncio.gather(*(worker() for _ in range(concurrency)))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=512, help="chunks per stream")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": "m", "max_tokens": args.chunks, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        print(f"{'client':<22} {'conc':>4} {'CPU ms / 1000 chunks':>21} {'vs aiohttp':>11}")
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            costs: dict[str, list[float]] = {"kimi-service (httpx)": [], "aiohttp": []}
            for _ in range(args.repeats):
                for name, client in (("kimi-service (httpx)", ours), ("aiohttp", theirs)):
                    before = cpu_seconds()
                    asyncio.run(client(url, body, concurrency, args.streams))
                    costs[name].append(1e6 * (cpu_seconds() - before) / (args.streams * args.chunks))
            baseline = sorted(costs["aiohttp"])[args.repeats // 2]
            for name, values in costs.items():
                median = sorted(values)[args.repeats // 2]
                print(f"{name:<22} {concurrency:>4} {median:>21.1f} {median / baseline:>10.2f}x")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
