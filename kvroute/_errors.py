"""The exceptions kvroute raises on purpose; every one derives from `KvRouteError`."""

from __future__ import annotations


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


class EventsDisabledError(DiscoveryError):
    """The engine answered, but KV-cache events are turned off there."""


class UnusableSourceError(DiscoveryError):
    """The engine advertised a source kvroute cannot subscribe to (transport, encoding, schema, policy)."""


class InvalidOptionsError(KvRouteError, ValueError):
    """Discovery options that cannot work (engine name, timeout, metadata, TLS, allow-list, cap)."""


class NoWorkersError(KvRouteError):
    """`Router.select` was left with no worker to choose from."""


class SnapshotError(KvRouteError):
    """A snapshot file is missing, corrupt, or of a version this kvroute cannot read."""
