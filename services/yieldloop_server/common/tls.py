"""A private certificate authority for a stack (``yieldloop up --tls``), made with ``cryptography``.

``<data_dir>/tls/``: ``ca.pem`` (what clients trust: ``YIELDLOOP_TLS_CA``, picked up by ``connect()``),
``ca.key``, ``server.pem`` and ``server.key`` (every service's certificate, for localhost, 127.0.0.1 and the
host the stack binds). Keys are written with mode 0600; an existing set is kept while it still covers the
hosts and has more than a week to run.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Sequence

CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE = "ca.pem", "ca.key", "server.pem", "server.key"
VALID_DAYS = 365


def _names(hosts: Sequence[str]) -> list:
    from cryptography import x509

    names: list = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", *hosts]):
        if not host or host in ("0.0.0.0", "::"):
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: pathlib.Path, data: bytes, private: bool) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _still_good(folder: pathlib.Path, hosts: Sequence[str]) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
        if not all((folder / name).exists() for name in (CA_FILE, KEY_FILE)):
            return False
    except (OSError, ValueError):
        return False
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    covered = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    return left > datetime.timedelta(days=7) and set(_names(hosts)) <= covered


def ensure_stack_certs(
    folder: pathlib.Path, hosts: Sequence[str] = ()
) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """(CA certificate, server certificate, server key) in ``folder``, made when missing or stale."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / CA_FILE, folder / CERT_FILE, folder / KEY_FILE
    if _still_good(folder, hosts):
        return paths
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "yieldloop stack CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "yieldloop services")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = dict(
        encoding=pem, format=serialization.PrivateFormat.PKCS8, encryption_algorithm=serialization.NoEncryption()
    )
    _write(folder / CA_KEY_FILE, ca_key.private_bytes(**private), private=True)
    _write(folder / KEY_FILE, key.private_bytes(**private), private=True)
    _write(folder / CERT_FILE, cert.public_bytes(pem), private=False)
    _write(folder / CA_FILE, ca.public_bytes(pem), private=False)
    return paths
