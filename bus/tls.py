"""TLS for the bus: a local CA and broker certificate, and a clear error for a client
whose TLS setting does not match the listener it reached.

``rollway broker start --tls`` serves SASL_SSL: on the first start :func:`ensure_broker_tls`
writes, under ``<data-dir>/tls/``,

* ``ca.pem``: the CA certificate clients trust (``kafka.ssl_cafile``; mode 0644: public);
* ``ca-key.pem``: the CA's private key (0600; only needed to sign more broker certs);
* ``broker.p12``: the brokers' private key and certificate chain, a PKCS#12 keystore
  (PBES2/AES-256, 0600; Kafka's PEM keystore reads only keys Java's SecretKeyFactory
  can decrypt, and Java 17 has no PBES2 there: "PBES2 SecretKeyFactory not available");
* ``broker.key-password``: the keystore's password (0600).

The broker certificate names every host clients use (``127.0.0.1`` and ``localhost`` by
default, ``--tls-host`` adds more) as subjectAltNames, so clients verify the hostname too.
The keys are EC P-256; the certificates are valid for ``days`` (default 825, the most a
browser-grade CA issues; a local cluster re-runs ``broker start`` long before).

aiokafka reports a TLS mismatch (a plaintext client on a TLS listener, a TLS client on a
plaintext one, a certificate the client does not trust) only as "Unable to bootstrap",
which a service would retry forever as a broker that is away. :func:`listener_mismatch`
asks the listener itself (one TCP connection and handshake) and returns the one line
that says what is wrong; ``bus.connect.start_client`` raises it as ``TlsMismatch``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import socket
import ssl
from pathlib import Path

import msgspec

from bus.security import NotAuthorized

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


class TlsMismatch(NotAuthorized):
    """The client's TLS setting does not fit the listener (one line; never retried)."""


class BrokerTls(msgspec.Struct, kw_only=True, frozen=True):
    """The files of a broker's TLS setup (paths)."""

    ca_file: str
    ca_key_file: str
    keystore_file: str  # PKCS#12
    key_password_file: str

    def key_password(self) -> str:
        return Path(self.key_password_file).read_text().strip()

    def server_properties(self, listener: str) -> dict[str, str]:
        """Kafka's settings for ``listener`` (e.g. ``sasl_ssl``) to serve TLS with these files."""
        prefix = f"listener.name.{listener.lower()}."
        return {
            prefix + "ssl.keystore.type": "PKCS12",
            prefix + "ssl.keystore.location": self.keystore_file,
            prefix + "ssl.keystore.password": self.key_password(),
            prefix + "ssl.key.password": self.key_password(),
            prefix + "ssl.truststore.type": "PEM",
            prefix + "ssl.truststore.location": self.ca_file,
            # Clients authenticate with SCRAM inside the TLS session, not with certificates.
            prefix + "ssl.client.auth": "none",
            "ssl.enabled.protocols": "TLSv1.3,TLSv1.2",
            # Brokers verify each other's hostnames too (inter-broker runs on this listener).
            "ssl.endpoint.identification.algorithm": "https",
        }


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, mode)


def _name(common_name: str):
    from cryptography.x509.oid import NameOID
    from cryptography import x509

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Rollway"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: tuple[str, ...]):
    from cryptography import x509

    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def ensure_broker_tls(folder: str | os.PathLike[str], hosts: tuple[str, ...] = DEFAULT_HOSTS,
                      days: int = 825) -> BrokerTls:
    """The CA and broker certificate in ``folder``, generated on first use. An existing
    broker certificate that lacks one of ``hosts`` is re-issued by the same CA (clients
    keep trusting ``ca.pem``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import pkcs12
    from cryptography.x509.oid import ExtendedKeyUsageOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    files = BrokerTls(ca_file=str(folder / "ca.pem"), ca_key_file=str(folder / "ca-key.pem"),
                      keystore_file=str(folder / "broker.p12"), key_password_file=str(folder / "broker.key-password"))
    now = dt.datetime.now(dt.timezone.utc)
    if Path(files.ca_file).exists() and Path(files.ca_key_file).exists():
        ca_cert = x509.load_pem_x509_certificate(Path(files.ca_file).read_bytes())
        ca_key = serialization.load_pem_private_key(Path(files.ca_key_file).read_bytes(), password=None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = (x509.CertificateBuilder()
                   .subject_name(_name("Rollway local CA")).issuer_name(_name("Rollway local CA"))
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        _write(Path(files.ca_key_file), ca_key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()), 0o600)
        _write(Path(files.ca_file), ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        Path(files.keystore_file).unlink(missing_ok=True)  # a new CA: the old broker cert is void
    if Path(files.keystore_file).exists() and Path(files.key_password_file).exists():
        held = pkcs12.load_pkcs12(Path(files.keystore_file).read_bytes(),
                                  Path(files.key_password_file).read_bytes().strip()).cert.certificate
        have = held.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if set(_san(hosts)) <= set(have) and held.not_valid_after_utc > now + dt.timedelta(days=1):
            return files
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(hosts[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    password = secrets.token_urlsafe(24)
    encryption = (serialization.PrivateFormat.PKCS12.encryption_builder().kdf_rounds(100_000)
                  .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC).hmac_hash(hashes.SHA256())
                  .build(password.encode()))
    keystore = pkcs12.serialize_key_and_certificates(b"broker", key, cert, [ca_cert], encryption)
    _write(Path(files.key_password_file), password.encode(), 0o600)
    _write(Path(files.keystore_file), keystore, 0o600)
    return files


# -- the client side -----------------------------------------------------------------------------

def _first_host(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    return host.strip("[]"), int(port)


def listener_mismatch(bootstrap: str, context: ssl.SSLContext | None, timeout: float = 10.0) -> str | None:
    """Why a client with ``context`` (None: no TLS) cannot talk to the first listener of
    ``bootstrap``, or None when TLS is not the problem (or the listener is away). One TCP
    connection; with TLS, one handshake. Runs only after a failed bootstrap, so the
    generous ``timeout`` (a loaded broker's JVM may answer a handshake slowly) delays only
    an error path; a port nobody listens on is refused at once."""
    host, port = _first_host(bootstrap)
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # away: the caller's "cannot reach" is the right message
    with raw:
        if context is None:
            probe = ssl.create_default_context()
            probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
            try:
                with probe.wrap_socket(raw, server_hostname=host):
                    pass
            except (ssl.SSLError, OSError):
                return None  # not TLS: plaintext meets plaintext
            return (f"kafka: {host}:{port} is a TLS listener and this client speaks plaintext; set "
                    "kafka.security_protocol = \"SASL_SSL\" and kafka.ssl_cafile to the CA that signed the broker's "
                    "certificate (rollway broker start --tls writes <data-dir>/tls/ca.pem)")
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return None  # the handshake works: TLS is not the problem
        except ssl.SSLCertVerificationError as exc:
            return (f"kafka: the broker at {host}:{port} presented a certificate this client does not trust "
                    f"({exc.verify_message}); set kafka.ssl_cafile to the CA that signed it "
                    "(rollway broker start --tls writes <data-dir>/tls/ca.pem)")
        except (ssl.SSLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", None) or type(exc).__name__
            return (f"kafka: {host}:{port} did not complete a TLS handshake ({reason}): it is not a TLS listener; "
                    "set kafka.security_protocol to SASL_PLAINTEXT (or \"auto\" without kafka.ssl_cafile), or "
                    "point kafka.bootstrap_servers at the broker's SASL_SSL listener")
        except OSError:
            return None
