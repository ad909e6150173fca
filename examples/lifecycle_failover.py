"""React to lifecycle events: stop routing to a worker while its index state is in doubt.

The `Router` already ignores the cached prefix of a worker that is not synced; this program goes
further, as a cautious deployment might: when a worker's events say it was reset (its engine
restarted), lost its connection, or is only partially known, it is taken out of the candidate
set until a ``synced`` event says the client has caught up with it again (and it is not partial).

Two simulated vLLM-style engines serve a stream of requests with a shared prefix. Mid-run one of
them restarts: its in-flight requests fail (and are sent again elsewhere), the client detects
the restart, resets that worker in the index and re-syncs it; meanwhile every request goes to
the other engine. The program prints each lifecycle event, what it did about it, and where the
requests went. Run: ``python examples/lifecycle_failover.py``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import anyio

from kvroute import Disconnected, KvEventClient, Partial, Reset, Router, Synced, WorkerKey
from kvroute.sim import RequestAbortedError, SimConfig, SimEngine

REQUESTS = 60
SHARED = list(range(1, 257))  # a 256-token system prompt every request starts with


class Quarantine:
    """Workers not to route to, driven by the client's lifecycle events."""

    def __init__(self, client: KvEventClient) -> None:
        self.client = client
        self.out: set[WorkerKey] = set()

    async def follow(self) -> None:
        async with self.client.events() as stream:
            async for env in stream:
                event, key = env.event, env.source.key
                if isinstance(event, (Reset, Disconnected, Partial)):
                    action = "still out of rotation" if key in self.out else "route elsewhere"
                    print(f"  {key.worker_id} rank {key.dp_rank}: {event!r} -> {action}")
                    self.out.add(key)
                elif isinstance(event, Synced) and key in self.out:
                    status = self.client.worker_status(key)
                    if status is not None and status.synced and not status.partial:
                        self.out.discard(key)
                        print(f"  {key.worker_id} rank {key.dp_rank}: synced again -> back in rotation")

    def candidates(self) -> set[WorkerKey]:
        healthy = self.client.live_workers() - self.out
        return healthy or self.client.live_workers()  # all in doubt: still serve, with no cache credit


async def main() -> None:
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(SimEngine(SimConfig(engine="vllm", name="vllm-a")))
        b = await stack.enter_async_context(SimEngine(SimConfig(engine="vllm", name="vllm-b")))
        engines = {e.grpc_target: e for e in (a, b) if e.grpc_target is not None}
        client = await stack.enter_async_context(KvEventClient(targets=list(engines)))
        await client.wait_synced(timeout=15)
        router = Router(client.index, states=client, block_size=16)
        quarantine = Quarantine(client)
        routed: Counter[str] = Counter()
        retried = 0

        async def request(i: int) -> None:
            nonlocal retried
            prompt = SHARED + [5000 + i * 40 + k for k in range(40)]
            for attempt in range(3):
                decision = router.select(prompt, candidates=quarantine.candidates(), request_id=(i, attempt))
                engine = engines[decision.worker.worker_id]
                try:
                    await engine.complete(prompt, max_tokens=8)
                except RequestAbortedError:
                    retried += 1  # died with its engine: route it again
                    continue
                finally:
                    router.on_finish((i, attempt))
                routed[engine.config.name] += 1
                return

        async with anyio.create_task_group() as tg:
            tg.start_soon(quarantine.follow)
            async with anyio.create_task_group() as requests:
                for i in range(REQUESTS):
                    if i == REQUESTS // 3:
                        print(f"request {i}: restarting {b.config.name}")
                        requests.start_soon(b.restart)
                    requests.start_soon(request, i)
                    await anyio.sleep(0.02)
            await anyio.sleep(0.2)  # the last lifecycle events
            tg.cancel_scope.cancel()
        print(f"requests per engine: {dict(routed)}; re-sent after the restart: {retried}")
        print(f"workers out of rotation at the end: {len(quarantine.out)}")


if __name__ == "__main__":
    anyio.run(main)
