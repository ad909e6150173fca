"""A minimal KV-aware HTTP router on asyncio: pick a backend per request with kvroute, forward it.

It starts three simulated engines (vLLM-style with 2 data-parallel ranks, SGLang-style, vLLM-style)
with their OpenAI-style HTTP servers, follows them through gRPC discovery, and serves
``POST /v1/completions`` on a local port. For each request it asks the `Router` for the worker
whose KV cache holds the longest prefix of the prompt (net of load), forwards the request to that
engine's real ``/v1/completions`` (the rank in vLLM's ``X-data-parallel-rank`` header), and
returns the engine's answer with an ``X-Kvroute-Worker`` header.

Then it plays client: conversations from a few users who share a system prompt go through the
router, and it prints where each went and how much of the prompt the engine found cached.

Only the standard library and kvroute: the HTTP client and server are a few lines on asyncio
streams (one request per connection, ``Content-Length`` bodies). Run: ``python examples/http_router.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from itertools import count

from kvroute import KvEventClient, Router, WorkerKey
from kvroute.sim import SimConfig, SimEngine

# A client or engine that sends a larger head than this is not one we want to talk to.
MAX_HEAD = 16 * 1024


async def http_request(
    host: str, port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 exchange on a fresh connection; returns (status, lower-cased headers, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status, response_headers = await read_head(reader)
        length = response_headers.get("content-length")
        data = await (reader.readexactly(int(length)) if length is not None else reader.read())
        return status, response_headers, data
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Read a status or request line and its headers; the int is the status (0 for a request)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > MAX_HEAD:
        raise ValueError("HTTP head too large")
    first, *fields = head.decode("latin-1").split("\r\n")
    headers = {}
    for field in fields:
        if ":" in field:
            name, value = field.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    parts = first.split(" ", 2)
    status = int(parts[1]) if first.startswith("HTTP/") else 0
    headers[":first-line"] = first
    return status, headers


class KvRouterServer:
    """``POST /v1/completions`` in, the same request out to the engine the `Router` picks."""

    def __init__(self, router: Router, backends: dict[str, tuple[str, int]]) -> None:
        self.router = router
        self.backends = backends  # worker_id (the engine's gRPC target) -> (host, HTTP port)
        self.ids = count()
        self.routed: dict[str, int] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _, headers = await read_head(reader)
            method, path, _ = headers[":first-line"].split(" ", 2)
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if (method, path) != ("POST", "/v1/completions"):
                await self.reply(writer, 404, b'{"error": "POST /v1/completions only"}')
                return
            await self.forward(body, writer)
        except (ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            await self.reply(writer, 400, json.dumps({"error": f"bad request: {exc}"}).encode())
        finally:
            writer.close()

    async def forward(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        prompt = json.loads(body)["prompt"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("this router routes token-id prompts")
        request_id = next(self.ids)
        decision = self.router.select(prompt, request_id=request_id)  # counts the request as load
        worker = decision.worker
        host, port = self.backends[worker.worker_id]
        try:
            status, _, answer = await http_request(
                host,
                port,
                "POST",
                "/v1/completions",
                body,
                {"Content-Type": "application/json", "X-data-parallel-rank": str(worker.dp_rank)},
            )
        finally:
            self.router.on_finish(request_id)
        name = f"{worker.worker_id}/rank{worker.dp_rank}"
        self.routed[name] = self.routed.get(name, 0) + 1
        await self.reply(writer, status, answer, {"X-Kvroute-Worker": name})

    @staticmethod
    async def reply(
        writer: asyncio.StreamWriter, status: int, body: bytes, extra: dict[str, str] | None = None
    ) -> None:
        lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        lines += [f"Content-Length: {len(body)}", "Connection: close"]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()


async def caught_up(client: KvEventClient, engines: list[SimEngine]) -> None:
    """Wait until the router's index has applied every engine rank's newest KV-event batch."""
    for _ in range(1000):  # 10 s at most
        cursors = client.cursors()
        newest = {
            WorkerKey(e.grpc_target or "", r): e.publisher(r).next_seq - 1
            for e in engines
            for r in range(e.config.ranks)
        }
        if all(w in cursors and cursors[w].seq == seq for w, seq in newest.items()):
            return
        await asyncio.sleep(0.01)
    raise SystemExit("the router's index did not catch up with the engines within 10 s")


async def main() -> None:
    configs = [
        SimConfig(engine="vllm", name="vllm-a", ranks=2),
        SimConfig(engine="sglang", name="sglang-b"),
        SimConfig(engine="vllm", name="vllm-c"),
    ]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in configs]
        backends = {e.grpc_target: ("127.0.0.1", e.http_port) for e in engines if e.grpc_target and e.http_port}
        client = await stack.enter_async_context(KvEventClient(targets=list(backends)))
        await client.wait_synced(timeout=15)
        router = Router(client.index, states=client, block_size=16)
        app = KvRouterServer(router, backends)
        server = await asyncio.start_server(app.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(f"router listening on http://127.0.0.1:{port}, {len(client.live_workers())} workers discovered")

        rng = random.Random(1)
        system = [rng.randrange(32_000) for _ in range(512)]
        totals = {"cached": 0, "prompt": 0, "history_hits": 0}

        async def user_turn(user: int, turn: int) -> str:
            # User u's conversation: the shared system prompt, then their own turns so far.
            history = system + [(user * 7919 + i) % 32_000 for i in range(128 * (turn + 1))]
            payload = json.dumps({"prompt": history, "max_tokens": 8}).encode()
            status, headers, body = await http_request(
                "127.0.0.1", port, "POST", "/v1/completions", payload, {"Content-Type": "application/json"}
            )
            if status != 200:
                raise SystemExit(f"router answered {status}: {body[:200]!r}")
            usage = json.loads(body)["usage"]
            hit = usage["prompt_tokens_details"]["cached_tokens"]
            totals["cached"] += hit
            totals["prompt"] += usage["prompt_tokens"]
            # Routed to where the conversation lives: everything but this turn's new 128 tokens is cached.
            totals["history_hits"] += int(turn > 0 and hit == usage["prompt_tokens"] - 128)
            return f"user {user}: {usage['prompt_tokens']:4d} tokens, {hit:4d} cached -> {headers['x-kvroute-worker']}"

        async with server:
            for turn in range(3):
                # Six users at once: load matters, so the router spreads them while keeping each
                # conversation where its history is cached.
                lines = await asyncio.gather(*(user_turn(user, turn) for user in range(6)))
                print(f"turn {turn}:\n  " + "\n  ".join(lines))
                await caught_up(client, engines)  # the next turn is routed on this one's blocks
        print(f"routed {sum(app.routed.values())} requests: {app.routed}")
        print(f"later turns that found their whole history cached: {totals['history_hits']} of 12")
        print(f"prefix-cache hit rate through the router: {totals['cached'] / totals['prompt']:.1%}")


if __name__ == "__main__":
    asyncio.run(main())
