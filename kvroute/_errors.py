"""The exceptions kvroute raises on purpose; every one derives from `KvRouteError` and is defined here.

(The simulator's and the command line's own errors live with them, in `kvroute.sim` and
`kvroute.cli`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._models import WorkerKey


class KvRouteError(Exception):
    """Base of every error kvroute raises on purpose."""


class ConfigError(KvRouteError, ValueError):
    """A configuration value is invalid, or does not fit this process (file descriptors, socket limits)."""


class ClientStateError(KvRouteError, RuntimeError):
    """A `KvEventClient` method was called in the wrong state (not running, or already running)."""


class DecodeError(KvRouteError):
    """A payload or frame could not be decoded into kvroute's typed events."""


class DiscoveryError(KvRouteError):
    """Asking an engine where its event sockets are failed.

    ``target`` is the ``host:port`` that was asked; ``cause`` a short reason.
    """

    def __init__(self, target: str, cause: str) -> None:
        super().__init__(f"{target}: {cause}")
        self.target = target
        self.cause = cause


class TargetUnreachableError(DiscoveryError):
    """No answer from the target: its name does not resolve, nothing listens, or no answer came in time."""


class RpcRejectedError(DiscoveryError):
    """The server answered the call with a permanent error status (not retried); ``code`` is its name."""

    def __init__(self, target: str, code: str, cause: str) -> None:
        super().__init__(target, cause)
        self.code = code


class MalformedAnswerError(DiscoveryError):
    """The engine answered something that breaks the discovery contract (bad JSON, missing key, duplicate rank)."""


class TooManySourcesError(DiscoveryError):
    """The answer lists more sources than ``max_sources_per_target`` allows."""


class EventsDisabledError(DiscoveryError):
    """The engine answered, but KV-cache events are turned off there."""


class UnusableSourceError(DiscoveryError):
    """The engine advertised a source kvroute cannot subscribe to (transport, encoding, schema, policy)."""


class InvalidOptionsError(ConfigError):
    """Discovery options that cannot work (engine name, timeout, metadata, TLS, allow-list, cap)."""


class IndexLimitsError(ConfigError):
    """An `IndexLimits` setting is not usable."""


class QueryError(KvRouteError, TypeError, ValueError):
    """A `find_matches` argument is not usable: a token id that is not an int in [0, 2**32), a
    ``lora_name`` / ``cache_salt`` that is not a str, an item that is not a `MultimodalItem`.
    The message names the argument and the first bad position. `Router.select` reports it as
    `RouterError`."""


class RouterError(ConfigError):
    """A `Router` or `CostModel` was given a setting or an input it cannot use."""


class NoWorkersError(KvRouteError):
    """`Router.select` was left with no worker to choose from."""


class SnapshotError(KvRouteError):
    """A snapshot file is missing, corrupt, or of a version this kvroute cannot read."""


class NotSyncedError(KvRouteError, TimeoutError):
    """`KvEventClient.wait_synced` timed out: what is still pending, and why.

    ``targets``: each target that has not answered discovery yet, with its last discovery error
    (or that none has come back yet). ``sources``: each source not synced, with its state and
    what it waits for. ``refused``: each source refused and never subscribed (``max_sources``,
    descriptors, an unusable endpoint), with why. Also a `TimeoutError`, so code catching that
    keeps working.
    """

    def __init__(
        self,
        timeout: float,
        targets: Mapping[str, str],
        sources: Mapping[WorkerKey, str],
        refused: Mapping[WorkerKey, str] | None = None,
    ) -> None:
        self.timeout = timeout
        self.targets = dict(targets)
        self.sources = dict(sources)
        self.refused = dict(refused or {})
        parts = [f"{len(self.refused)} sources refused"] if self.refused else []
        parts += [f"refused {k.worker_id}[{k.dp_rank}]: {why}" for k, why in self.refused.items()]
        parts += [f"target {t}: {why}" for t, why in self.targets.items()]
        parts += [f"source {k.worker_id}[{k.dp_rank}]: {why}" for k, why in self.sources.items()]
        shown = "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")
        super().__init__(f"not synced after {timeout:g} s: {shown or 'nothing pending (stopped?)'}")


class MetricsError(KvRouteError):
    """An engine's ``/metrics`` could not be fetched or is not Prometheus text."""


class JetStreamError(KvRouteError):
    """The NATS server could not be reached or refused a JetStream request."""
