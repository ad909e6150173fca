"""A KV-aware, OpenAI-compatible HTTP router: Starlette + httpx + kvroute (``pip install 'kvroute[examples]'``).

The router (`build_app`) serves ``POST /v1/completions`` and ``POST /v1/chat/completions``. Per request it

1. gets the prompt's token ids: a token-id prompt as is, otherwise from an engine's ``POST /tokenize``
   (vLLM's endpoint; chat messages go through the engine's own chat template there). That is one
   HTTP round trip plus the engine's tokenizer per request; the alternative is the
   model's tokenizer in the router process (``transformers``' ``AutoTokenizer``, the same files the
   engine loads), which costs CPU in the router instead, and must apply the same chat template;
2. asks the `kvroute.Router` for the worker (engine x data-parallel rank) that holds the longest
   prefix, net of load, and records the request there (`Router.on_start`);
3. forwards the request body unchanged to that engine, the rank in the ``X-data-parallel-rank``
   header (vLLM 0.34 reads it in ``OpenAIServing._get_data_parallel_rank``; SGLang 0.5.23 reads the
   same header, and the ``routed_dp_rank`` body field), streaming the answer back as it comes
   (server-sent events passed through byte for byte);
4. tells the router when the first bytes came (`Router.on_prefill_done`: the prompt is prefilled)
   and when the answer ended (`Router.on_finish`), whatever happened.

Where to send it: kvroute names workers by their engine's gRPC target and rank; each target is given
with its engine's HTTP base URL (``KvEventClient(targets={grpc_target: http_url})``; SGLang names its
HTTP server in its discovery answer, vLLM does not), and `KvEventClient.http_url(worker)` answers where
a worker's requests go, so the router keeps no table of its own.

Caught up: before the next turn, the example waits until the index holds each routed prompt on its
worker (`PrefixIndex.find_matches`, what a router reads anyway); a real router never waits, it routes
on what the index holds at that moment.

`main` starts three simulated engines, runs the router under uvicorn on a free loopback port and plays
client with the ``openai`` package: six users' chat conversations (three turns each, half of them
streamed) sharing a system prompt. It prints where each turn went and how much of its prompt the
engine found cached. Run: ``python examples/http_router.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from openai import AsyncOpenAI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute import KvEventClient, Router, WorkerKey
from kvroute.sim import SimConfig, SimEngine

# Response headers that describe the upstream connection, not the answer: never copied.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class KvRouter:
    """The routing step of each request: token ids, the `Router`'s choice, the forwarded call."""

    def __init__(self, router: Router, client: KvEventClient, http: httpx.AsyncClient) -> None:
        self.router = router
        self.client = client  # where each worker's requests go: client.http_url(worker)
        self.http = http
        self.ids = itertools.count()
        self.routed: dict[str, int] = {}
        self.recent: list[tuple[list[int], WorkerKey]] = []  # what to wait for in `settled`

    async def token_ids(self, body: dict[str, Any], chat: bool, engine: str) -> list[int]:
        """The prompt's token ids as the engine will see them (``engine``'s /tokenize, unless ids were sent)."""
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        query = {"messages": body["messages"]} if chat else {"prompt": prompt}
        answer = await self.http.post(f"{engine}/tokenize", json=query)
        answer.raise_for_status()
        tokens: list[int] = answer.json()["tokens"]
        return tokens

    async def forward(self, request: Request) -> Response:
        """Route one OpenAI-style request and pass the engine's answer (streamed or not) through."""
        chat = request.url.path.endswith("/chat/completions")
        # Any engine of the fleet tokenizes: they serve the same model, so the same tokenizer and template.
        engines = sorted(u for w in self.client.live_workers() if (u := self.client.http_url(w)) is not None)
        if not engines:
            return JSONResponse({"error": {"message": "no engine with a known HTTP URL"}}, status_code=503)
        try:
            body = await request.json()
            tokens = await self.token_ids(body, chat, engines[0])
        except (ValueError, KeyError, httpx.HTTPError) as exc:
            return JSONResponse({"error": {"message": f"bad request: {exc}"}}, status_code=400)
        decision = self.router.select(tokens)
        worker = decision.worker
        base = self.client.http_url(worker)
        if base is None:
            return JSONResponse({"error": {"message": f"no HTTP URL known for {worker}"}}, status_code=502)
        rid = next(self.ids)
        self.router.on_start(rid, worker, tokens, cached_tokens=decision.overlap_tokens)
        name = f"{worker.worker_id}/rank{worker.dp_rank}"
        self.routed[name] = self.routed.get(name, 0) + 1
        self.recent.append((tokens, worker))
        upstream = self.http.build_request(
            "POST",
            f"{base}{request.url.path}",
            json=body,
            headers={"X-data-parallel-rank": str(worker.dp_rank)},
        )
        try:
            answer = await self.http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            self.router.on_finish(rid)
            return JSONResponse({"error": {"message": f"engine unreachable: {exc}"}}, status_code=502)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Kvroute-Worker"] = name
        return StreamingResponse(
            self._relay(answer, rid), status_code=answer.status_code, headers=headers, media_type=None
        )

    async def _relay(self, answer: httpx.Response, rid: int) -> AsyncIterator[bytes]:
        try:
            first = True
            async for chunk in answer.aiter_raw():
                if first and chunk:
                    first = False
                    self.router.on_prefill_done(rid)  # the engine is past this prompt's prefill
                yield chunk
        finally:
            await answer.aclose()
            self.router.on_finish(rid)

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until the index holds every routed prompt on its worker (so the next turn can find it)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.recent and asyncio.get_running_loop().time() < deadline:
            tokens, worker = self.recent[-1]
            scores = self.router.index.find_matches(tokens)
            block_size = scores.block_size(worker)
            if block_size is not None and scores.get(worker, 0) >= len(tokens) // block_size:
                self.recent.pop()
            else:
                await asyncio.sleep(0.01)


def build_app(kv: KvRouter) -> Starlette:
    """The ASGI app: the two OpenAI routes, both through `KvRouter.forward`."""
    return Starlette(
        routes=[
            Route("/v1/completions", kv.forward, methods=["POST"]),
            Route("/v1/chat/completions", kv.forward, methods=["POST"]),
        ]
    )


async def main() -> None:
    configs = [
        SimConfig(engine="vllm", name="vllm-a", ranks=2),
        SimConfig(engine="sglang", name="sglang-b"),
        SimConfig(engine="vllm", name="vllm-c"),
    ]
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimEngine(cfg)) for cfg in configs]
        # Each engine's gRPC target (discovery, events) with its HTTP base URL (requests).
        targets = {e.grpc_target: e.http_url for e in engines if e.grpc_target and e.http_url}
        client = await stack.enter_async_context(KvEventClient(targets=targets))
        await client.wait_synced(timeout=15)
        http = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        kv = KvRouter(Router(client.index, states=client), client, http)

        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(build_app(kv), log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110  (uvicorn sets a flag, no event, once it listens)
            await asyncio.sleep(0.01)
        print(f"router listening on http://127.0.0.1:{port}, {len(client.live_workers())} workers discovered")

        openai = await stack.enter_async_context(
            AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        )
        system = "You are a terse assistant for the kvroute project. " * 40
        conversations: list[list[dict[str, str]]] = [[{"role": "system", "content": system}] for _ in range(6)]
        previous = [0] * 6
        totals = {"cached": 0, "prompt": 0, "history_hits": 0}

        async def user_turn(user: int, turn: int) -> str:
            messages = conversations[user]
            messages.append({"role": "user", "content": f"user {user} asks question {turn}: " + "why " * 60})
            if user % 2:  # streamed: the router passes the server-sent events through
                stream = await openai.chat.completions.create(
                    model="sim-model",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                reply, usage = "", None
                async for chunk in stream:
                    reply += "".join(c.delta.content or "" for c in chunk.choices)
                    usage = chunk.usage or usage
                worker = stream.response.headers["x-kvroute-worker"]
            else:
                raw = await openai.chat.completions.with_raw_response.create(
                    model="sim-model",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=8,
                )
                answer = raw.parse()
                reply, usage = answer.choices[0].message.content or "", answer.usage
                worker = raw.headers["x-kvroute-worker"]
            assert usage is not None and usage.prompt_tokens_details is not None
            hit = usage.prompt_tokens_details.cached_tokens or 0
            messages.append({"role": "assistant", "content": reply})
            totals["cached"] += hit
            totals["prompt"] += usage.prompt_tokens
            # Routed to where the conversation lives: its whole earlier prompt (whole blocks) is cached.
            totals["history_hits"] += int(turn > 0 and hit >= previous[user] // 16 * 16)
            previous[user] = usage.prompt_tokens
            kind = "streamed" if user % 2 else "whole   "
            return f"user {user} ({kind}): {usage.prompt_tokens:4d} tokens, {hit:4d} cached -> {worker}"

        for turn in range(3):
            # Six users at once: load matters, so the router spreads them while keeping each
            # conversation where its history is cached.
            lines = await asyncio.gather(*(user_turn(user, turn) for user in range(6)))
            print(f"turn {turn}:\n  " + "\n  ".join(lines))
            await kv.settled()  # the next turn is routed on this one's blocks
        server.should_exit = True
        await serving
        print(f"routed {sum(kv.routed.values())} requests: {kv.routed}")
        print(f"later turns that found their whole history cached: {totals['history_hits']} of 12")
        print(f"prefix-cache hit rate through the router: {totals['cached'] / totals['prompt']:.1%}")


if __name__ == "__main__":
    asyncio.run(main())
