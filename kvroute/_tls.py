"""TLS for kvroute's gRPC channels (discovery and the gateway event stream): one config, one reader."""

from __future__ import annotations

from pathlib import Path

import grpc
import msgspec

from ._errors import DiscoveryError, InvalidOptionsError

__all__ = ["TlsConfig"]


class TlsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """TLS for the gRPC channels: discovery and the gateway event stream.

    Each PEM item is given as ``bytes`` (the PEM content itself) or ``str`` (a path to a PEM
    file, read at every discovery so rotated certificates are picked up). ``root_certificates``
    None uses grpc's default roots. ``private_key`` and ``certificate_chain`` (both or neither)
    present a client certificate. ``server_name`` overrides the name the server's certificate
    is checked against (e.g. when dialling an IP address).
    """

    root_certificates: bytes | str | None = None
    private_key: bytes | str | None = None
    certificate_chain: bytes | str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise InvalidOptionsError("TLS private_key and certificate_chain go together (a client certificate)")

    def __repr__(self) -> str:
        # A private key given as PEM bytes never reaches a log or a traceback (a path may).
        key = "<secret>" if isinstance(self.private_key, bytes) else repr(self.private_key)
        return (
            f"TlsConfig(root_certificates={_short(self.root_certificates)}, private_key={key}, "
            f"certificate_chain={_short(self.certificate_chain)}, server_name={self.server_name!r})"
        )

    def credentials(self, target: str) -> grpc.ChannelCredentials:
        """Channel credentials for ``target``, PEM files read now (raises `DiscoveryError` if one cannot be)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(target, "root_certificates", self.root_certificates),
            private_key=_read_pem(target, "private_key", self.private_key),
            certificate_chain=_read_pem(target, "certificate_chain", self.certificate_chain),
        )


def _short(pem: bytes | str | None) -> str:
    return f"<{len(pem)} bytes of PEM>" if isinstance(pem, bytes) else repr(pem)


def _read_pem(target: str, name: str, item: bytes | str | None) -> bytes | None:
    if item is None or isinstance(item, bytes):
        return item
    try:
        return Path(item).read_bytes()
    except OSError as exc:
        raise DiscoveryError(target, f"cannot read TLS {name} file {item}: {exc.strerror or exc}") from None
