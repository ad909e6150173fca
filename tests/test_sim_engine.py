"""The simulated engine over real sockets: events a SUB decodes, replay, HTTP completions, gRPC discovery, restarts."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq
from _publisher_helpers import served, wait_for

from kvroute._discovery import discover
from kvroute._index import PrefixIndex
from kvroute._models import WorkerKey
from kvroute._transports.zmq import sockets as _zmq
from kvroute._wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvroute.sim._cache import CapacityError, InvalidRequestError
from kvroute.sim._engine import RequestAbortedError, SimConfig, SimEngine
from kvroute.sim._http import detokenize, tokenize
from kvroute.sim._publisher import EventPublisher

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
END = b"\xff" * 8
# Fast steps: the tests check behaviour, not realistic timing.
FAST = {"decode_time_per_step": 0.001, "prefill_time_per_token": 1e-6, "block_size": 4}


@asynccontextmanager
async def engine(**overrides: Any) -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(**{**FAST, **overrides})) as eng:
        yield eng


@asynccontextmanager
async def zmq_socket(kind: int, endpoint: str) -> AsyncIterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = _zmq.connect(ctx, kind, endpoint, subscribe=b"" if kind == zmq.SUB else None)
    try:
        yield sock
    finally:
        _zmq.close(sock)


async def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every buffered (seq, payload) from ``start``, either reply layout, until the end marker."""
    out: list[tuple[int, bytes]] = []
    async with zmq_socket(zmq.DEALER, endpoint) as dealer:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        with anyio.fail_after(5):
            while True:
                for frames in await _zmq.recv_many(dealer, 1000):
                    seq8, payload = frames[-2], frames[-1]
                    assert frames[0] == b"" and len(frames) in (3, 4)
                    if seq8 == END:
                        return out
                    out.append((int.from_bytes(seq8, "big"), payload))


async def history(eng: SimEngine, rank: int) -> list[EventBatch]:
    """The rank's whole event history as a subscriber gets it: replayed from seq 0, contiguous, decoded."""
    items = await replay(eng.sources()[rank].replay_endpoint or "")
    assert [seq for seq, _ in items] == list(range(len(items)))
    return [decode_batch(payload) for _, payload in items]


def prompts(seed: int, n: int, *, shared: int = 3, vocab: int = 50) -> list[list[int]]:
    """Prompts that share prefixes (a few system prompts, then varying suffixes)."""
    rng = random.Random(seed)
    bases = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 24))] for _ in range(shared)]
    return [rng.choice(bases) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 16))] for _ in range(n)]


def assert_index_is_truth(
    eng: SimEngine, index: PrefixIndex, worker: WorkerKey, rank: int, queries: Sequence[Sequence[int]]
) -> None:
    cache = eng.cache(rank)
    assert index.num_blocks(worker) == cache.num_cached_blocks
    for q in queries:
        assert index.find_matches(q).get(worker, 0) == served(cache, q), q


# --- events ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flavour",
    [
        {"engine": "vllm"},
        {"engine": "vllm", "form": "array", "reply_layout": "old", "bytes_hashes": True},
        {"engine": "sglang"},
    ],
    ids=["vllm", "vllm-old-bytes", "sglang"],
)
async def test_events_reach_a_subscriber_and_rebuild_the_cache(flavour: dict[str, Any]) -> None:
    async with engine(ranks=2, capacity_blocks=24, **flavour) as eng:
        sources = eng.sources()
        async with zmq_socket(zmq.SUB, sources[0].endpoint) as sub0, zmq_socket(zmq.SUB, sources[1].endpoint) as sub1:
            live: list[list[list[bytes]]] = [[], []]

            async def read(i: int, sock: zmq.Socket[bytes]) -> None:
                while True:
                    live[i].extend(await _zmq.recv_many(sock, 100))

            qs = prompts(1, 40)

            async def complete(q: list[int], rank: int) -> None:
                await eng.complete(q, 3, rank=rank)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read, 0, sub0)
                tg.start_soon(read, 1, sub1)
                with anyio.fail_after(10):
                    # Repeat until both SUBs have joined (a PUB drops what it sends before that).
                    while not (live[0] and live[1]):
                        async with anyio.create_task_group() as load:
                            for i, q in enumerate(qs):
                                load.start_soon(complete, q, i % 2)
                tg.cancel_scope.cancel()
        for rank in (0, 1):
            batches = await history(eng, rank)
            # Live messages are [topic, seq8, payload] and match the replayed copy byte for byte.
            replayed = dict(await replay(sources[rank].replay_endpoint or ""))
            for frames in live[rank]:
                assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
                assert replayed[int.from_bytes(frames[1], "big")] == frames[2]
            assert all(b.data_parallel_rank == rank for b in batches)
            stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
            assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)  # capacity forced evictions
            if eng.config.engine == "sglang":
                assert all(len(e.block_hashes) == 1 for e in stored)  # one event per page
            if eng.config.bytes_hashes:
                assert all(isinstance(h, bytes) and len(h) == 32 for e in stored for h in e.block_hashes)
            worker = WorkerKey("w", rank)
            index = PrefixIndex()
            for b in batches:
                index.apply_batch(worker, b)
            assert_index_is_truth(eng, index, worker, rank, qs)


async def test_sglang_hashes_are_signed_on_the_wire() -> None:
    async with engine(engine="sglang") as eng:
        for q in prompts(2, 20, vocab=1000):
            await eng.complete(q, 1)
        raw = [msgspec.msgpack.decode(p) for _, p in await replay(eng.sources()[0].replay_endpoint or "")]
    hashes = [h for batch in raw for ev in batch[1] if ev["type"] == "BlockStored" for h in ev["block_hashes"]]
    assert any(h < 0 for h in hashes) and all(-(1 << 63) <= h < 1 << 63 for h in hashes)


async def joined(eng: SimEngine, sub: zmq.Socket[bytes]) -> None:
    """Return once ``sub`` receives the engine's messages (slow joiner), with nothing left unread."""
    with anyio.fail_after(10):
        for n in range(10_000):
            await eng.complete([9000 + n] * 5, 1)  # a prompt not cached yet: it stores a block
            with anyio.move_on_after(0.05):
                await _zmq.wait_readable(sub)
                break
        # Drain: the checks that follow see only what is sent from here on.
        while True:
            with anyio.move_on_after(0.05):
                await _zmq.recv_many(sub, 100)
                continue
            break


async def test_drop_pause_and_dead_replay() -> None:
    async with engine() as eng:
        src = eng.sources()[0]
        async with zmq_socket(zmq.SUB, src.endpoint) as sub:
            await joined(eng, sub)  # so "nothing arrived" below means nothing was sent
            eng.drop_rate = 1.0
            for q in prompts(3, 5):
                await eng.complete(q, 2)
            with anyio.move_on_after(0.1):
                await _zmq.wait_readable(sub)
                pytest.fail("a dropped message arrived")
            assert len(await replay(src.replay_endpoint or "")) == eng.publisher().published  # drops stay replayable
            eng.drop_rate = 0.0
            eng.pause()
            await eng.complete([7] * 9, 2)
            with anyio.move_on_after(0.1):
                await _zmq.wait_readable(sub)
                pytest.fail("a held message arrived")
            eng.resume()
            with anyio.fail_after(5):
                (frames,) = await _zmq.recv_many(sub, 1)
            assert any(isinstance(e, BlockStored) for e in decode_batch(frames[2]).events)
        eng.kill_replay()
        async with zmq_socket(zmq.DEALER, src.replay_endpoint or "") as dealer:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            with anyio.move_on_after(0.2):
                await _zmq.wait_readable(dealer)
                pytest.fail("a killed replay endpoint answered")
        eng.revive_replay()
        assert len(await replay(src.replay_endpoint or "")) == eng.publisher().published


@pytest.mark.parametrize("change_ports", [False, True])
async def test_restart_resets_seq_cache_and_requests(change_ports: bool) -> None:
    async with engine(ranks=1, decode_time_per_step=0.01) as eng:
        q = list(range(20))
        await eng.complete(q, 2)
        before = eng.sources()
        old_first = (await history(eng, 0))[0].events[0]
        assert isinstance(old_first, BlockStored)
        long = eng.submit(list(range(100, 120)), 200)
        await wait_for(lambda: long.generated > 0, "the long request is running")
        await eng.restart(change_ports=change_ports)
        with pytest.raises(RequestAbortedError):
            await long.result()
        assert eng.restarts == 1
        assert eng.cache().num_cached_blocks == 0 and eng.cache().num_running == 0
        assert eng.publisher().next_seq == 0 and await replay(eng.sources()[0].replay_endpoint or "") == []
        assert (eng.sources()[0].endpoint != before[0].endpoint) == change_ports
        result = await eng.complete(q, 2)
        assert result.cached_tokens == 0  # the cache died with the process
        new_first = (await history(eng, 0))[0].events[0]
        assert isinstance(new_first, BlockStored)
        assert new_first.token_ids == old_first.token_ids
        assert new_first.block_hashes != old_first.block_hashes  # vLLM's hash seed is per process


async def test_reset_prefix_cache_sends_all_blocks_cleared() -> None:
    async with engine() as eng:
        await eng.complete(list(range(12)), 1)
        assert eng.reset_prefix_cache()
        assert eng.cache().num_cached_blocks == 0
        last = (await history(eng, 0))[-1]
        assert [type(e).__name__ for e in last.events] == ["AllBlocksCleared"]
        running = eng.submit(list(range(12)), 50)
        assert not eng.reset_prefix_cache()
        eng.abort(running)


# --- scheduling and the time model --------------------------------------------------------------


async def test_cache_hits_cut_time_to_first_token() -> None:
    async with engine(prefill_time_per_token=5e-4, decode_time_per_step=0.001, block_size=16) as eng:
        prompt = list(range(400))
        cold = await eng.complete(prompt, 2)
        warm = await eng.complete(prompt, 2)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 384
    assert cold.ttft >= 400 * 5e-4
    assert warm.ttft < cold.ttft / 3
    assert warm.output_token_ids == cold.output_token_ids  # a greedy model: same prompt, same output


async def test_a_stalled_host_does_not_show_in_the_simulated_times() -> None:
    # The event loop is blocked for 0.2 s mid-request (a busy host waking the rank late): the rank
    # catches up on its own timeline, so TTFT and latency are the model's, exactly.
    async with engine(prefill_time_per_token=1e-5, decode_time_per_step=0.01, block_size=16) as eng:
        running = eng.submit(list(range(400)), 20, stream=True)
        first = True
        async for _ in running.tokens():
            if first:
                first = False
                time.sleep(0.2)  # noqa: ASYNC251  (on purpose: the loop is blocked, every step due meanwhile is late)
        done = await running.result()
    assert done.ttft == pytest.approx(0.01 + 400 * 1e-5)
    assert done.latency == pytest.approx(0.01 + 400 * 1e-5 + 19 * 0.01)
    assert done.queue_time == 0.0


async def test_requests_queue_when_the_cache_is_full() -> None:
    step = 0.005
    async with engine(capacity_blocks=10, decode_time_per_step=step) as eng:
        # 5 blocks each: only two fit at once. The times compared are the model's own timeline
        # (arrival, admission, step ends), not the host's: a stall of the test process between two
        # submits moves an arrival in wall time, and the engine's catch-up then shortens the wait.
        reqs = [eng.submit([i] * 15, 5) for i in range(3)]
        done = [await r.result() for r in reqs]
        first, second, queued = reqs
        assert first.admitted_at == second.admitted_at == max(first.arrival, second.arrival)
        # When each of the first two finished (arrival + latency: float sums, hence the 1 ns slack).
        end = min(r.arrival + c.latency for r, c in zip(reqs[:2], done[:2], strict=True)) - 1e-9
        # The third is admitted only once a running request has finished (first come, first served):
        # after the first two's 5 steps (prefill + 4 decodes) of at least ``step`` each, and its
        # reported queue time is that wait (zero only if the host stalled a whole 5 steps between submits).
        assert queued.admitted_at >= end >= first.admitted_at + 5 * step - 2e-9
        assert done[2].queue_time == queued.admitted_at - queued.arrival
        assert done[2].queue_time == pytest.approx(max(0.0, end - queued.arrival), abs=1e-8)
        assert [c.queue_time for c in done[:2]] == [first.admitted_at - first.arrival, 0.0]  # admitted together
        with pytest.raises(CapacityError):
            eng.submit([1] * 40, 1)
        with pytest.raises(InvalidRequestError):
            eng.submit([eng.config.vocab_size], 1)
        with pytest.raises(InvalidRequestError):
            eng.submit([1], 1, rank=1)
    with pytest.raises(RequestAbortedError):
        eng.submit([1], 1)  # stopped


async def test_outputs_are_deterministic_across_engines_and_seeds() -> None:
    async with engine(seed=1, name="a") as a, engine(seed=2, name="b", engine="sglang") as b:
        ra = await a.complete([5, 6, 7, 8, 9], 6)
        rb = await b.complete([5, 6, 7, 8, 9], 6)
    assert ra.output_token_ids == rb.output_token_ids


# --- HTTP ----------------------------------------------------------------------------------------


class Http:
    """A tiny HTTP/1.1 client over one persistent connection (the tests own both ends)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        from anyio.streams.buffered import BufferedByteReceiveStream

        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def raw(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        await self.stream.send(data)
        with anyio.fail_after(10):
            head = await self.reader.receive_until(b"\r\n\r\n", 65536)
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while True:
                    size = int(await self.reader.receive_until(b"\r\n", 16), 16)
                    chunk = await self.reader.receive_exactly(size + 2)
                    if size == 0:
                        break
                    body += chunk[:-2]
            else:
                body = await self.reader.receive_exactly(int(headers.get("content-length", "0")))
        return status, headers, body

    async def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: sim\r\nContent-Length: {len(data)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        return await self.raw(head.encode() + b"\r\n" + data)


@asynccontextmanager
async def http(eng: SimEngine) -> AsyncIterator[Http]:
    assert eng.http_port is not None
    async with await anyio.connect_tcp("127.0.0.1", eng.http_port) as stream:
        yield Http(stream)


async def test_http_completions_report_growing_cached_tokens() -> None:
    async with engine(block_size=4) as eng, http(eng) as client:
        conversation = list(range(1, 30))
        cached = []
        for _turn in range(3):  # a multi-turn chat: each turn resends the history plus new tokens
            status, headers, body = await client.request(
                "POST", "/v1/completions", {"prompt": conversation, "max_tokens": 6, "return_token_ids": True}
            )
            assert status == 200 and headers["content-type"] == "application/json"
            answer = json.loads(body)
            usage = answer["usage"]
            assert usage["prompt_tokens"] == len(conversation) and usage["completion_tokens"] == 6
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            out = answer["choices"][0]["token_ids"]
            assert answer["choices"][0]["text"] == detokenize(out)
            conversation = conversation + out + [7, 7, 7, 7, 7]
        assert cached[0] == 0 and cached[0] < cached[1] < cached[2]
        # Text prompts: the trivial tokenizer round-trips the engine's own output.
        text = "the quick brown fox jumps over the lazy dog again and again"
        _, _, body = await client.request("POST", "/v1/completions", {"prompt": text, "max_tokens": 3})
        reply = json.loads(body)["choices"][0]["text"]
        assert tokenize(text + reply, eng.config.vocab_size)[-3:] == tokenize(reply, eng.config.vocab_size)
        _, _, body = await client.request("POST", "/v1/completions", {"prompt": [text + reply], "max_tokens": 1})
        assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8


async def test_http_rank_selection_streaming_and_info_routes() -> None:
    async with engine(ranks=2, lora_names=("ad",)) as eng, http(eng) as client:
        status, _, body = await client.request(
            "POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}, {"X-data-parallel-rank": "1"}
        )
        assert status == 200 and json.loads(body)["sim"]["rank"] == 1
        _, _, body = await client.request("POST", "/v1/completions", {"prompt": [1], "data_parallel_rank": 1})
        assert json.loads(body)["sim"]["rank"] == 1
        status, headers, body = await client.request(
            "POST",
            "/v1/completions",
            {"prompt": [4, 5, 6], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert status == 200 and headers["content-type"] == "text/event-stream"
        events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) != ""
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        _, _, body = await client.request("POST", "/v1/completions", {"prompt": [4, 5], "model": "ad", "max_tokens": 1})
        assert json.loads(body)["model"] == "ad"
        status, _, body = await client.request("GET", "/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["sim-model", "ad"]
        status, _, body = await client.request("GET", "/kv_event_sources")
        configs = json.loads(body)
        assert sorted(configs) == ["0", "1"] and configs["1"]["endpoint"] == eng.advertised_sources()[1].endpoint
        status, _, _ = await client.request("GET", "/health")
        assert status == 200


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{bad}", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 400),
        (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n{"prompt":[-1]}', 400),
        (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 25\r\n\r\n{"prompt":[[1],[2]],"x":1}', 400),
        (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 27\r\n\r\n{"prompt":[1],"model":"no"}', 404),
        (b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 29\r\n\r\n{"prompt":[1],"max_tokens":0}', 400),
        (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
        (b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
        (b"GET /health HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GARBAGE\r\n\r\n", 400),
        (b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", 200),  # a stray CRLF before the request line is allowed
        (b"GET /health HTTP/1.0\r\n\r\n", 200),
        ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"), 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    ],
)
async def test_http_refuses_bad_requests_with_clear_errors(request_bytes: bytes, status: int) -> None:
    async with engine(http_port=0, grpc_port=None) as eng, http(eng) as client:
        got, _, body = await client.raw(request_bytes)
        assert got == status
        if body:
            assert json.loads(body)["error"]["code"] == status
        # The server still serves (a fresh connection when it closed this one).
        async with http(eng) as again:
            assert (await again.request("GET", "/health"))[0] == 200


async def test_http_request_in_flight_during_restart_gets_503() -> None:
    async with engine(decode_time_per_step=0.01) as eng, http(eng) as client:
        async with anyio.create_task_group() as tg:
            got: list[int] = []

            async def call() -> None:
                got.append((await client.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 500}))[0])

            tg.start_soon(call)
            await wait_for(lambda: eng.cache().num_running > 0, "the request is in flight")
            await eng.restart()
        assert got == [503]


# --- the async with block ------------------------------------------------------------------------------


async def test_an_error_raised_in_the_block_leaves_it_as_raised() -> None:
    # As with KvEventClient: the engine's and the publisher's task groups must not wrap the caller's own
    # exception in an ExceptionGroup, or `except TimeoutError` around the block misses a `fail_after`.
    with pytest.raises(TimeoutError) as info:
        async with engine(http_port=None):
            with anyio.fail_after(0.01):
                await anyio.sleep_forever()
    assert type(info.value) is TimeoutError
    with pytest.raises(ValueError, match="the caller's own") as raised:
        async with EventPublisher():
            raise ValueError("the caller's own")
    assert type(raised.value) is ValueError
    # Cancelling the block from outside still ends it quietly.
    with anyio.move_on_after(0.05) as scope:
        async with engine(http_port=None):
            await anyio.sleep_forever()
    assert scope.cancelled_caught


# --- discovery -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flavour",
    [
        {"engine": "vllm", "ranks": 2, "advertise_host": "*"},
        {"engine": "vllm", "ranks": 1, "replay_port": None},
        {"engine": "sglang", "ranks": 3},
        {"engine": "sglang", "ranks": 2, "advertise_host": "0.0.0.0", "replay_port": None},
    ],
    ids=["vllm-wildcard", "vllm-no-replay", "sglang-3", "sglang-wildcard-no-replay"],
)
async def test_discovery_finds_what_the_engine_publishes(flavour: dict[str, Any]) -> None:
    async with engine(**flavour) as eng:
        assert eng.grpc_target is not None
        # A bound, not a measurement: a loaded 2-core machine has taken over 5 s to answer.
        found = await discover(eng.grpc_target, timeout=30)
        expected = eng.sources()
        assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.topic, s.engine) for s in found] == [
            (s.dp_rank, s.endpoint, s.replay_endpoint, s.topic, s.engine) for s in expected
        ]
        if eng.config.engine == "sglang":
            ports = [int(s.endpoint.rsplit(":", 1)[1]) for s in found]
            assert ports == list(range(ports[0], ports[0] + len(ports)))  # base + rank
            assert all(s.block_size == eng.config.block_size for s in found)
        await eng.restart(change_ports=True)
        again = await discover(eng.grpc_target, timeout=30)
        assert [s.endpoint for s in again] == [s.endpoint for s in eng.sources()]
        assert {s.endpoint for s in again}.isdisjoint(s.endpoint for s in found)


# --- the command line ---------------------------------------------------------------------------------


def test_cli_runs_until_interrupted() -> None:
    code = (
        "import argparse, sys\n"
        "from kvroute.cli._sim import register\n"
        "p = argparse.ArgumentParser(prog='kvroute'); register(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
    )
    args = ["sim", "--engine", "sglang", "--ranks", "2", "--block-size", "8", "--decode-time-per-step", "0.001"]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(6)]
        assert "sglang engine" in lines[0] and lines[-1].startswith("Ctrl-C")
        url = lines[1].split()[1]
        host, port = url.removeprefix("http://").split(":")
        import http.client

        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "a b c d e f g h i j", "max_tokens": 2}))
        answer = json.loads(conn.getresponse().read())
        assert answer["usage"]["completion_tokens"] == 2
        conn.close()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- with kvroute's own client ------------------------------------------------------------------------


async def test_kvroute_client_index_converges_to_the_engines_ground_truth() -> None:
    from kvroute._client import KvEventClient
    from kvroute._transports.zmq.config import SubscriberConfig

    config = SubscriberConfig(quiet_interval=0.1, replay_timeout=0.5)
    async with (
        engine(engine="vllm", ranks=2, capacity_blocks=40, drop_rate=0.3, seed=5) as v,
        engine(engine="sglang", ranks=1, capacity_blocks=40, name="s") as s,
    ):
        assert v.grpc_target is not None and s.grpc_target is not None
        async with KvEventClient(targets=[v.grpc_target, s.grpc_target], config=config) as client:
            await client.wait_synced(5)
            qs = prompts(6, 60)

            async def complete(eng: SimEngine, q: list[int]) -> None:
                await eng.complete(q, 4)

            async with anyio.create_task_group() as tg:
                for i, q in enumerate(qs):
                    tg.start_soon(complete, v if i % 3 else s, q)
            workers = [(v, WorkerKey(v.grpc_target, 0), 0), (v, WorkerKey(v.grpc_target, 1), 1)]
            workers.append((s, WorkerKey(s.grpc_target, 0), 0))
            await converged(client, workers, qs)
            assert v.publisher(0).dropped + v.publisher(1).dropped > 0
            # reset_prefix_cache: the vLLM engine drops everything (AllBlocksCleared), then refills.
            assert v.reset_prefix_cache()
            async with anyio.create_task_group() as tg:
                for q in qs[:20:3]:
                    tg.start_soon(complete, v, q)
            await converged(client, workers, qs)
            assert v.cache(0).num_cached_blocks + v.cache(1).num_cached_blocks > 0


async def converged(
    client: Any, workers: list[tuple[SimEngine, WorkerKey, int]], qs: Sequence[Sequence[int]]
) -> None:
    """Wait until the client's index equals every engine's cache (lost messages come back by replay)."""
    with anyio.fail_after(10):
        while True:
            try:
                for eng, key, rank in workers:
                    assert_index_is_truth(eng, client.index, key, rank, qs)
            except AssertionError:
                await anyio.sleep(0.05)
            else:
                return


async def test_sglang_events_carry_the_engines_hashes() -> None:
    # The SGLang engine writes its hashes as int64; the client's events carry them in the
    # space the engine's cache names them (uint64), so removals and routers agree on ids.
    from kvroute._client import KvEventClient
    from kvroute._transports.zmq.config import SubscriberConfig

    async with (
        engine(engine="sglang", capacity_blocks=40, seed=7) as s,
        KvEventClient(s.sources("s"), config=SubscriberConfig(quiet_interval=0.1)) as client,
    ):
        stream = client.events()
        await client.wait_synced(5)
        qs = prompts(8, 30, vocab=1000)
        for q in qs:
            await s.complete(q, 2)
        delivered: set[object] = set()
        want = s.cache().block_hashes()
        assert any(isinstance(h, int) and h >= 1 << 63 for h in want)  # signed on the wire
        with anyio.fail_after(10):
            async for env in stream:
                if isinstance(env.event, BlockStored):
                    delivered.update(env.event.block_hashes)
                if want <= delivered:
                    break
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in delivered)


# SGLang 0.5.23's own encoder (disaggregation/kv_events.py), two production shapes:
# "sglang-lora" (hash -301 over [1..4], lora_id 7, lora_name "sql-lora") and "sglang-salt"
# (hashes -101/-102 over [1..8], cache_salt "tenant-a"); ts 1700000000.5, rank 0.
SGLANG_GOLDEN = [
    "93cb41d954fc402000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391d1fed3b170"
    "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72"
    "615f696407a66d656469756da3475055a96c6f72615f6e616d65a873716c2d6c6f726100",
    "93cb41d954fc402000009188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d09bd09ab1"
    "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a65"
    "04a76c6f72615f6964c0a66d656469756da3475055aa63616368655f73616c74a874656e616e742d6100",
]


@pytest.mark.parametrize(
    "golden",
    [SGLANG_GOLDEN[0], SGLANG_GOLDEN[1]],
    ids=["sglang-lora", "sglang-salt"],
)
def test_the_simulators_sglang_bytes_are_sglangs(golden: str) -> None:
    # The simulated SGLang engine publishes through EventPublisher(signed_hashes=True). What it
    # writes for the batch SGLang encoded must be what SGLang wrote: the same msgpack document
    # read by a plain msgpack decoder (not kvroute's), keys in SGLang's order. Only the map
    # header's width may differ (SGLang's fixmap, a map16 here): a msgpack detail no reader sees.
    raw = bytes.fromhex(golden)
    batch = decode_batch(raw)
    ours = encode_batch(batch, form="map", signed_hashes=True)
    theirs_doc, ours_doc = msgspec.msgpack.decode(raw), msgspec.msgpack.decode(ours)
    assert ours_doc == theirs_doc
    assert [list(ev) for ev in ours_doc[1]] == [list(ev) for ev in theirs_doc[1]]
    assert ours.replace(b"\xde\x00\x08", b"\x88") == raw
