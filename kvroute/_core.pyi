"""Types of the compiled core, `kvroute._core` (src/py/): private; the public API is the Python package."""

from typing import Any

HASH_VERSION: int
MAX_DEPTH: int

def xxh128(data: bytes) -> bytes: ...

# --- wire (src/py/wire.rs) ---------------------------------------------------------------------
def decode_batch(payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int) -> Any:
    """Decode one payload into kvroute._wire.EventBatch; raises kvroute.DecodeError."""

def decode_count(
    payload: Any, max_events_per_batch: int, max_blocks_per_event: int, max_block_size: int
) -> tuple[float, int, int, int, int, str | None, dict[str, int]]:
    """Decode one payload to ``(ts, events, stored_blocks, removed_blocks, clears, untrusted, skipped)``."""
