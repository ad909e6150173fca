"""Where a discovery answer may point the router: hosts judged as addresses, and the endpoint policy.

What a discovery answer says is data from the network, and it decides where the router
connects. Hosts are judged as addresses, not spellings: every IPv4 shorthand libzmq would accept
("127.1", "2130706433", "0x7f000001"), IPv4-mapped IPv6, and host names (resolved here, in the
discovery's thread, then connected to by the address judged) count as loopback or unspecified
when they are; an unspecified address is a wildcard (the dialled host). The policy itself is in
`kvroute._discovery`'s module docstring.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Sequence
from typing import Final, Protocol

import anyio
import anyio.to_thread
import msgspec

from ._errors import DiscoveryError, InvalidOptionsError, UnusableSourceError
from ._models import EventSource


class Policy(Protocol):
    """What the endpoint policy and the answer readers need of `kvroute.DiscoveryOptions`."""

    @property
    def allow_ipc(self) -> bool:
        """Accept ipc:// endpoints of an engine on this host."""
        ...

    @property
    def allowed_hosts(self) -> Sequence[str] | None:
        """Hosts and networks an endpoint may point at (None: any)."""
        ...

    @property
    def max_sources_per_target(self) -> int:
        """The most sources one answer may list."""
        ...

    @property
    def worker_id(self) -> str | None:
        """The name of the target's workers (None: the target)."""
        ...


# The underscored names are discovery's own helpers (kvroute._discovery imports them); one module each.
__all__ = [
    "Policy",
    "_LOCAL_NAMES",
    "_HostAllowList",
    "_Resolver",
    "_Unusable",
    "_address",
    "_fmt_host",
    "_is_local",
    "_pin_names",
    "_resolve",
    "parse_target",
]

# Bind-all hosts an engine may advertise (docs/protocol.md §1), compared without brackets.
_WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "::"})
# Host names a discovery answer may use: DNS-ish labels (underscores appear in container names).
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?")
class _HostAllowList:
    """``allowed_hosts`` parsed: IP networks (single addresses are /32 or /128) and host names."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.names: set[str] = set()
        for entry in entries:
            text = entry.strip().strip("[]") if isinstance(entry, str) else ""
            if not text:
                raise InvalidOptionsError(f"allowed_hosts entry {entry!r} is empty or not a string")
            try:
                self.networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if "/" in text or not _HOST_NAME.fullmatch(text):
                raise InvalidOptionsError(
                    f"allowed_hosts entry {entry!r} is neither an IP, a CIDR network nor a host name"
                )
            self.names.add(text.lower())

    def allows(self, host: str) -> bool:
        address = _ip(host)
        if address is None:
            return host.lower() in self.names
        return any(address.version == net.version and address in net for net in self.networks)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# The IPv4 spellings inet_aton (and so getaddrinfo, and so libzmq) also accepts: 1 to 4 parts,
# each decimal, octal or hex ("127.1", "2130706433", "0x7f000001", "0177.0.0.1", "0").
_INET_ATON = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")
_LOCAL_NAMES: Final = frozenset({"localhost", "localhost.", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` spells, however it spells it; None for a host name.

    Judged as an address, not a spelling: shorthand IPv4 is expanded, an IPv4-mapped or
    IPv4-compatible IPv6 address is its IPv4 address.
    """
    address = _ip(host)
    if address is None and _INET_ATON.fullmatch(host):
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        packed = address.packed
        if packed[:12] == bytes(12) and packed[12:] != bytes(4) and address != ipaddress.IPv6Address("::1"):
            return ipaddress.IPv4Address(packed[12:])  # ::a.b.c.d, the deprecated compatible form
    return address


def _this_host(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Connecting to ``address`` reaches this machine: loopback, or unspecified (0.0.0.0, ::)."""
    return address.is_loopback or address.is_unspecified


def _is_local(host: str) -> bool:
    address = _address(host)
    return _this_host(address) if address is not None else host.lower() in _LOCAL_NAMES


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host without brackets, port); a `DiscoveryError` when malformed."""
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
        address = _ip(host)
        ok = bool(sep) and address is not None and address.version == 6
    else:
        host, sep, port = target.rpartition(":")
        ok = bool(sep) and ":" not in host and _HOST_NAME.fullmatch(host) is not None
    if not ok or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(
            target, "target must be host:port with port 1-65535, no scheme (IPv6 in brackets: [::1]:50051)"
        )
    return host, int(port)


class _Unusable(Exception):
    """One endpoint failed the policy; the message is the reason."""


class _Resolver:
    """Turns advertised endpoints into connectable, policy-checked ones for one dialled host."""

    def __init__(
        self,
        dialled: str,
        options: Policy,
        dialled_addresses: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address] = (),
    ) -> None:
        self.dialled = dialled
        self.dialled_addresses = list(dialled_addresses)
        # A dialled name is judged by what it resolved to (discover_with resolves it first).
        self.dialled_is_local = _is_local(dialled) or any(_this_host(a) for a in dialled_addresses)
        self.allow_ipc = options.allow_ipc
        self.allow_list = None if options.allowed_hosts is None else _HostAllowList(options.allowed_hosts)

    def endpoint(self, endpoint: str) -> str:
        scheme, sep, rest = endpoint.partition("://")
        scheme = scheme.lower()
        if not sep:
            raise _Unusable(f"{endpoint!r} is not a ZMQ endpoint (transport://address)")
        if scheme == "tcp":
            return self._tcp(endpoint, rest)
        if scheme == "ipc":
            if not self.allow_ipc:
                raise _Unusable(f"{endpoint}: ipc:// endpoints are refused unless allow_ipc is set")
            if not self.dialled_is_local:
                raise _Unusable(f"{endpoint}: ipc:// is a path on the engine's host, and {self.dialled} is remote")
            if not rest:
                raise _Unusable(f"{endpoint}: empty ipc path")
            return endpoint
        allowed = "tcp://, ipc://" if self.allow_ipc else "tcp://"
        raise _Unusable(f"{endpoint}: transport {scheme}:// is not supported (accepted: {allowed})")

    def _tcp(self, endpoint: str, rest: str) -> str:
        if rest.startswith("["):
            host, sep, port = rest[1:].partition("]:")
        else:
            host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise _Unusable(f"{endpoint}: needs host:port with a port in 1-65535")
        address = _address(host)
        if host in _WILDCARD_HOSTS or (address is not None and address.is_unspecified):
            host, address = self.dialled, _address(self.dialled)
        elif address is None and not _HOST_NAME.fullmatch(host):
            raise _Unusable(f"{endpoint}: {host!r} is not an IP address or host name")
        elif _is_local(host) and not self.dialled_is_local:
            raise _Unusable(f"{endpoint}: bound to loopback on {self.dialled}, unreachable from here")
        if self.allow_list is not None and not self.allow_list.allows(host if address is None else str(address)):
            raise _Unusable(f"{endpoint}: host {host} is not in allowed_hosts")
        # Connect to the address judged, in its canonical form: libzmq must not read another
        # meaning into a spelling. A host name is resolved and judged later (`_pin_names`).
        return f"tcp://{_fmt_host(host if address is None else str(address))}:{int(port)}"




async def _resolve(
    target: str, host: str, deadline: float, limiter: anyio.CapacityLimiter
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address ``host`` resolves to (in this discovery's own worker thread, within its deadline)."""
    try:
        with anyio.fail_after(max(0.0, deadline - time.monotonic())):
            infos = await anyio.to_thread.run_sync(
                socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM, abandon_on_cancel=True, limiter=limiter
            )
    except (OSError, TimeoutError) as exc:
        raise UnusableSourceError(target, f"cannot resolve {host!r}: {exc or 'timed out'}") from None
    out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for info in infos:
        address = _address(str(info[4][0]).partition("%")[0])
        if address is not None and address not in out:
            out.append(address)
    if not out:
        raise UnusableSourceError(target, f"{host!r} resolves to no address")
    return out


async def _pin_names(
    target: str, sources: list[EventSource], resolver: _Resolver, deadline: float, limiter: anyio.CapacityLimiter
) -> list[EventSource]:
    """Resolve every host name the answer uses, judge the addresses, and connect to those instead.

    A name resolving to this machine (loopback or unspecified) from a remote target is refused
    like the address itself; resolving here and connecting to the result means a later DNS
    answer cannot send the router somewhere the policy never saw.
    """
    if resolver.dialled_is_local:
        return sources  # a target on this machine may point anywhere: nothing to judge
    # The dialled name (a wildcard's substitute) is pinned to what it was judged by.
    pinned: dict[str, str] = {}
    if resolver.dialled_addresses:
        pinned[resolver.dialled] = _fmt_host(str(resolver.dialled_addresses[0]))

    async def pin(endpoint: str | None) -> str | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        rest = endpoint[len("tcp://") :]
        host, _, port = rest.rpartition(":")
        if host.startswith("[") or _address(host) is not None:
            return endpoint
        if host not in pinned:
            addresses = await _resolve(target, host, deadline, limiter)
            if not resolver.dialled_is_local and any(_this_host(a) for a in addresses):
                raise UnusableSourceError(
                    target,
                    f"unusable KV-event source: {endpoint}: {host} resolves to this machine "
                    f"({', '.join(map(str, addresses))}), and {resolver.dialled} is remote",
                )
            pinned[host] = _fmt_host(str(addresses[0]))
        return f"tcp://{pinned[host]}:{port}"

    out = []
    for src in sources:
        endpoint = await pin(src.endpoint)
        assert endpoint is not None
        out.append(msgspec.structs.replace(src, endpoint=endpoint, replay_endpoint=await pin(src.replay_endpoint)))
    return out
