"""Certificates made in a test: a CA, a server certificate for 127.0.0.1 and client
certificates with a chosen common name and subject alternative names (DNS, URI)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Authority:
    """A CA in ``directory`` that issues certificates as PEM file pairs."""

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvtier test {name}")])
        self.cert_file = self._write(name, self._key, self._build(self._name, self._key, True))

    def issue(
        self,
        name: str,
        common_name: str,
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> tuple[Path, Path]:
        """(certificate, key) files of a certificate this CA signed."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        san: list[x509.GeneralName] = [
            *(x509.DNSName(d) for d in dns),
            *(x509.UniformResourceIdentifier(u) for u in uris),
            *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips),
        ]
        cert = self._build(subject, key, False, san)
        return self._write(name, key, cert), self.directory / f"{name}.key"

    def server(self) -> tuple[Path, Path]:
        return self.issue("server", "kvtier test server", ips=("127.0.0.1",))

    def _build(
        self,
        subject: x509.Name,
        key: ec.EllipticCurvePrivateKey,
        ca: bool,
        san: list[x509.GeneralName] | None = None,
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name if not ca else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(self._key, hashes.SHA256())

    def _write(self, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Path:
        cert_file = self.directory / f"{name}.crt"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_file


def certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it (one
    call, fixed names: ``ca.crt``, ``server.crt``/``.key``, ``client.crt``/``.key``)."""
    now = datetime.datetime.now(datetime.UTC)
    files: dict[str, Path] = {}

    def issue(name: str, issuer_key, issuer_name, ca: bool, san: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        files[f"{name}.crt"] = directory / f"{name}.crt"
        files[f"{name}.key"] = directory / f"{name}.key"
        files[f"{name}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{name}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return key, subject

    ca_key, ca_name = issue("ca", None, None, ca=True, san=False)
    issue("server", ca_key, ca_name, ca=False, san=True)
    issue("client", ca_key, ca_name, ca=False, san=False)
    return files
