"""The Router's footprint: where it recently placed new sessions, so the next one goes where fewest went.

A cost model prices one request: a new session (a prompt no worker holds much of) costs the same on
every idle worker, so the cheapest is any of them, drawn at random, and over a run some ranks start
several times the new sessions of others. Each new session then grows turn by turn in the cache it
started in; the ranks that took many evict the earlier sessions' histories before their next turn
(docs/routing-quality.md: the cause of kvroute's shortfall against session affinity on the
conversation shape). The footprint is a count per worker of the new placements the router made
there, each decaying by half every ``CostModel.footprint_half_life`` new placements (decay by
placements, not by time: the count compares workers, and a clock-free count means the same at any
request rate). `CostModel.footprint_band` bounds what it may override, and it never trades load.
Among the workers tied at the fewest placements and then the least cost, listed candidates and idle
workers alike, the router's rng draws one (``randrange``) in `WorkerKey` order.

The counts and the pick live in the compiled core (src/scoring.rs `Footprint`, src/py/router.rs
`kvroute._core.Footprint`): the compiled `select` picks there, and the Python scoring path
(`kvroute._scoring`) calls the same pick, so both choose identically for the same state and rng.
"""

from __future__ import annotations

from ._core import Footprint

__all__ = ["Footprint"]
