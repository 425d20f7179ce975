"""TLS and mTLS credentials for servers and client channels, from `auth.tls` (PEM files)."""

from __future__ import annotations

from pathlib import Path

import grpc

from arlo.config import ConfigError, TlsConfig


def _read(field: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"auth.tls.{field}: cannot read {path}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise ConfigError(f"auth.tls.{field}: {path} is not a PEM file")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """The server's certificate; with `require_client_cert`, clients must present one signed by ca_file."""
    key, cert = _read("key_file", tls.key_file), _read("cert_file", tls.cert_file)
    ca = _read("ca_file", tls.ca_file) if tls.ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=tls.require_client_cert)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Verifies servers with ca_file (system roots when empty) and presents our certificate (for mTLS).

    The certificate goes out even when the server does not ask for one: one config then works
    against TLS and mTLS servers alike.
    """
    ca = _read("ca_file", tls.ca_file) if tls.ca_file else None
    key = _read("key_file", tls.key_file) if tls.key_file else None
    cert = _read("cert_file", tls.cert_file) if tls.cert_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(tls: TlsConfig) -> list[tuple[str, str]]:
    # Only for a name the certificate carries that is not the dialled host (an IP, a pod name).
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
