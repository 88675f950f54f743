"""A throwaway CA and a home certificate signed by it, for the channel's tests."""

from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_tls(folder: str, host: str = "localhost", expired: bool = False) -> dict[str, str]:
    """Write ca.pem, home.pem and home.key (a certificate for ``host`` and 127.0.0.1, valid
    now, or ``expired`` a minute ago) into ``folder``; their paths by name."""
    now = datetime.datetime.now(datetime.timezone.utc)
    until = now - datetime.timedelta(minutes=1) if expired else now + datetime.timedelta(days=1)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("diloco-ray test CA"))
        .issuer_name(_name("diloco-ray test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(host))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {name: os.path.join(folder, name) for name in ("ca.pem", "home.pem", "home.key")}
    pem = serialization.Encoding.PEM
    with open(paths["ca.pem"], "wb") as f:
        f.write(ca.public_bytes(pem))
    with open(paths["home.pem"], "wb") as f:
        f.write(cert.public_bytes(pem))
    with open(paths["home.key"], "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths
