"""Certificates made in the test: a CA, server and client pairs signed by it, expired ones.

Built with ``cryptography`` (a test extra) because the openssl CLI cannot
back-date a certificate, and an expired certificate is one of the cases tested.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAMES = ("localhost",)
IPS = ("127.0.0.1", "::1")


@dataclass
class Pair:
    cert: Path
    key: Path


class CA:
    """A certificate authority in ``directory``; ``issue`` writes pairs it signs."""

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        *,
        client: bool = False,
        expired: bool = False,
        common_name: str | None = None,
        uris: tuple[str, ...] = (),
    ) -> Pair:
        """A server (or client) pair for localhost/127.0.0.1/::1, files named ``name``; its subject
        CN is ``common_name`` (default ``name``), ``uris`` are added as URI names (SPIFFE ids);
        ``expired`` ended yesterday."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        if expired:
            start, end = now - datetime.timedelta(days=10), now - datetime.timedelta(days=1)
        else:
            start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7)
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in NAMES]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in IPS]
        sans += [x509.UniformResourceIdentifier(uri) for uri in uris]
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        pair = Pair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return pair


def serial_of(pem: bytes | str) -> int:
    """The serial number of a PEM certificate (tells two pairs apart in the rotation test)."""
    data = pem.encode() if isinstance(pem, str) else pem
    return x509.load_pem_x509_certificate(data).serial_number


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
