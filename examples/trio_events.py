"""Consume ``client.events()`` from a trio program: every engine and lifecycle event, as it happens.

It starts a simulated SGLang-style engine with 2 data-parallel ranks (kvroute and its simulator
run on trio as well as asyncio), subscribes through gRPC discovery, and runs two tasks in a
nursery: one sends requests with a shared prefix to both ranks, the other reads the client's
event stream and prints it — connections, cold-start replays, syncs, the blocks each step
stored. It stops after the requests are done and the stream has gone quiet, then prints totals.

Run: ``python examples/trio_events.py`` (trio comes with ``pip install 'kvroute[examples]'``).
"""

from __future__ import annotations

import sys
from collections import Counter

try:
    import trio
    import trio.testing
except ImportError:  # kvroute itself runs without trio: say what to install instead of a traceback
    sys.exit("examples/trio_events.py needs trio: pip install 'kvroute[examples]'")

from kvroute import BlockRemoved, BlockStored, KvEventClient, WorkerKey
from kvroute.sim import SimConfig, SimEngine

REQUESTS = 12
# Printed in full; after that only counted, so the output stays short.
PRINT_FIRST = 15


async def send_requests(engine: SimEngine) -> None:
    shared = list(range(1, 129))  # 128 tokens every request starts with: 8 blocks of 16
    for i in range(REQUESTS):
        prompt = shared + [1000 + i * 50 + k for k in range(40)]
        done = await engine.complete(prompt, max_tokens=4, rank=i % 2)
        print(f"  request {i} on rank {done.rank}: {done.cached_tokens}/{done.prompt_tokens} tokens cached")


async def caught_up(client: KvEventClient, engine: SimEngine) -> None:
    """Wait until the index has applied each rank's newest batch, and the stream has had time to deliver it."""
    with trio.fail_after(10):
        while True:
            cursors = client.cursors()
            newest = {WorkerKey(engine.grpc_target or "", r): engine.publisher(r).next_seq - 1 for r in range(2)}
            if all(w in cursors and cursors[w].seq == seq for w, seq in newest.items()):
                break
            await trio.sleep(0.01)
    await trio.testing.wait_all_tasks_blocked()  # the stream's reader took what was delivered


async def main() -> None:
    async with SimEngine(SimConfig(engine="sglang", name="sglang-demo", ranks=2)) as engine:
        assert engine.grpc_target is not None
        async with KvEventClient(targets=[engine.grpc_target]) as client:
            kinds: Counter[str] = Counter()
            blocks_stored = 0

            async def consume() -> None:
                nonlocal blocks_stored
                async with client.events() as stream:
                    async for env in stream:
                        event = env.event
                        kind = getattr(event, "kind", type(event).__name__)
                        kinds[kind] += 1
                        where = f"{env.source.worker_id} rank {env.source.dp_rank}"
                        if isinstance(event, BlockStored):
                            blocks_stored += len(event.block_hashes)
                            detail = f"seq {env.seq}: {len(event.block_hashes)} blocks stored"
                        elif isinstance(event, BlockRemoved):
                            detail = f"seq {env.seq}: {len(event.block_hashes)} blocks removed"
                        else:
                            detail = f"lifecycle {event!r}"
                        if sum(kinds.values()) <= PRINT_FIRST:
                            print(f"{where}: {detail}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await client.wait_synced(timeout=15)
                await send_requests(engine)
                await caught_up(client, engine)  # the last steps' events are on their way
                nursery.cancel_scope.cancel()
            print(f"events by kind: {dict(kinds)}")
            print(f"blocks stored per the stream: {blocks_stored}; in the index now: {client.index.num_blocks()}")


if __name__ == "__main__":
    trio.run(main)
