"""Who is on the other end of a pipeline's link: mutual TLS 1.3 between a driver and its stages.

Every stage process and every driver has an ed25519 key (a stage's ``<cache>/stage.key``, the
driver's worker key). Its **certificate** is a self-signed X.509 certificate of that key, made
the same way every time (:func:`certificate`: fixed names, serial and validity; ed25519 signs
deterministically), so it is a public fact of the key: it travels in the key's signed
announcement (:mod:`stoa.fleet.stages.discovery`). A link is a TLS 1.3 connection (Python's
``ssl``, OpenSSL) in which each side presents its certificate and trusts exactly the one
certificate of the peer it expects (:func:`context`): the driver the stage key it allows, the
stage the driver key it allows. Nothing of the handshake is Stoa's own cryptography; Stoa only
decides which key each side expects.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from typing import Any, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from stoa.transport.signing import key_id, load_private_key

__all__ = ["certificate", "certificate_key", "context"]

_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)


def certificate(private_key: Any) -> bytes:
    """The PEM certificate of ``private_key`` (see the module docstring): subject and issuer
    ``CN=stoa <key id>``, serial from the key id, valid 2000-9999, a CA of itself (so that it can
    be the one certificate a peer trusts)."""
    key = load_private_key(private_key)
    kid = key_id(key.public_key())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"stoa {kid}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(int(kid[:15], 16) + 1).not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, None))
    return cert.public_bytes(serialization.Encoding.PEM)


def certificate_key(pem: bytes) -> Ed25519PublicKey:
    """The ed25519 public key of a PEM certificate, which must be self-signed by it.

    Raises:
        ValueError: not one PEM certificate, not of an ed25519 key, or not signed by its own key.
    """
    try:
        cert = x509.load_pem_x509_certificate(pem)
        pub = cert.public_key()
        if not isinstance(pub, Ed25519PublicKey):
            raise ValueError("not an ed25519 key")
        pub.verify(cert.signature, cert.tbs_certificate_bytes)
    except Exception as e:  # noqa: BLE001 - whatever a stranger's bytes break, it is their fault
        raise ValueError(f"not a self-signed ed25519 certificate: {type(e).__name__}: {str(e)[:200]}") from None
    return pub


def context(side: Literal["server", "client"], private_key: Any, peer: bytes) -> ssl.SSLContext:
    """A TLS 1.3 context for one link: presents ``private_key``'s certificate and accepts only the
    peer whose certificate is ``peer`` (PEM). No host name is checked: the peer is named by its key."""
    key = load_private_key(private_key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if side == "server" else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    certificate_key(peer)  # refuse anything but one self-signed ed25519 certificate
    with tempfile.TemporaryDirectory(prefix="stoa-tls-") as d:  # ssl loads a key only from a file
        key_file, cert_file = os.path.join(d, "key.pem"), os.path.join(d, "cert.pem")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        with open(cert_file, "wb") as f:
            f.write(certificate(key))
        ctx.load_cert_chain(cert_file, key_file)
    ctx.load_verify_locations(cadata=peer.decode("ascii"))
    return ctx
