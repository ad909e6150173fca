"""Static configuration: no discovery, the event sources written down by hand.

For engines without a gRPC discovery server (older releases, or a deployment that pins ports),
each data-parallel rank's publisher is described by an `EventSource`: where its PUB socket is,
where its replay ROUTER is (optional, but it is what recovers lost messages), and its block size.
Here that list is built from a small config table, the way a router would read it from a file.

Two simulated engines are started on fixed, pre-chosen ports with discovery turned off; the
client subscribes to the listed sources, and the `Router` routes prompts that share prefixes.
Run: ``python examples/static_config.py``.
"""

from __future__ import annotations

import contextlib
import socket

import anyio

from kvroute import EventSource, KvEventClient, Router, WorkerKey
from kvroute.sim import SimConfig, SimEngine


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (a real deployment has them in its config)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def caught_up(client: KvEventClient, engines: dict[str, SimEngine]) -> None:
    """Wait until the router's index has applied every engine's newest KV-event batch."""
    with anyio.fail_after(10):
        while True:
            cursors = client.cursors()
            newest = {WorkerKey(name, 0): e.publisher(0).next_seq - 1 for name, e in engines.items()}
            if all(w in cursors and cursors[w].seq == seq for w, seq in newest.items()):
                return
            await anyio.sleep(0.01)


async def main() -> None:
    pub_a, replay_a, pub_b, replay_b = free_ports(4)
    # The static config: worker name -> (engine, PUB port, replay port). Nothing is discovered.
    config = {"gpu-node-1": ("vllm", pub_a, replay_a), "gpu-node-2": ("sglang", pub_b, replay_b)}
    sources = [
        EventSource(
            worker_id=name,
            dp_rank=0,
            endpoint=f"tcp://127.0.0.1:{pub}",
            replay_endpoint=f"tcp://127.0.0.1:{replay}",
            block_size=16,
            engine="static",
        )
        for name, (_, pub, replay) in config.items()
    ]
    async with contextlib.AsyncExitStack() as stack:
        engines = {}
        for name, (kind, pub, replay) in config.items():
            sim = SimConfig(
                engine="vllm" if kind == "vllm" else "sglang",
                name=name,
                grpc_port=None,  # no discovery server at all
                http_port=None,
                event_port=pub,
                replay_port=replay,
            )
            engines[name] = await stack.enter_async_context(SimEngine(sim))
        client = await stack.enter_async_context(KvEventClient(sources))
        await client.wait_synced(timeout=15)
        names = sorted(w.worker_id for w in client.live_workers())
        print(f"subscribed to {len(names)} static sources: {names}")
        router = Router(client.index, states=client, block_size=16, seed=0)

        documents = {name: list(range(base, base + 320)) for name, base in (("manual", 1), ("faq", 10_000))}

        async def ask(round_: int, doc: str) -> None:
            prompt = documents[doc] + [20_000 + round_ * 10 + k for k in range(24)]
            decision = router.select(prompt, request_id=(round_, doc))  # its load counts until on_finish
            try:
                done = await engines[decision.worker.worker_id].complete(prompt, max_tokens=4)
            finally:
                router.on_finish((round_, doc))
            print(
                f"round {round_} {doc:>6}: -> {decision.worker.worker_id}"
                f" (index: {decision.overlap_blocks} blocks cached; engine found {done.cached_tokens} tokens)"
            )

        for round_ in range(3):
            async with anyio.create_task_group() as tg:  # both documents at once: load spreads them
                for doc in documents:
                    tg.start_soon(ask, round_, doc)
            await caught_up(client, engines)  # the next round is routed on this one's blocks
        print(f"index: {client.index.num_blocks()} blocks over {len(client.index.workers())} workers")


if __name__ == "__main__":
    anyio.run(main)
