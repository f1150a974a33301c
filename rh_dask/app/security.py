"""TLS credentials for a Dask cluster: a CA and one certificate per role, and their checks.

``rh-dask certs DIR`` (:func:`write_credentials`) writes a fresh certificate
authority and, signed by it, a certificate and private key for each of the
three roles of a cluster::

    DIR/ca.pem                              the CA's certificate (every party trusts it)
    DIR/scheduler.pem, scheduler-key.pem    the scheduler's
    DIR/worker.pem,    worker-key.pem       every worker's (one pair for all of them)
    DIR/client.pem,    client-key.pem       the client's (rh-dask fit, your Python session)

The CA's private key is never written: nothing can sign a further
certificate, so a leaked directory cannot mint new identities, and making
new credentials means a new directory for the whole cluster. Private keys are
written readable by their owner only (mode 0600, the directory 0700).

Dask verifies both ends of every connection against ``ca.pem`` (mutual
authentication: ``ssl.CERT_REQUIRED`` on both sides) and does not check host
names, so the certificates work whatever address the scheduler is reached at.

:func:`client_security` turns credentials (a directory, explicit files, or
dask's ``distributed.comm.tls.*`` settings) into a
:class:`distributed.security.Security` for a client, after checking that
each file exists, holds what it should, is valid now and was signed by the
CA; a problem raises :class:`CertificateError` naming the file.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..exceptions import CertificateError

__all__ = [
    "CA_FILE",
    "ROLES",
    "CertificateError",
    "Credentials",
    "check_credentials",
    "client_security",
    "cluster_security",
    "credentials_in",
    "security_for",
    "write_credentials",
]

#: The roles ``rh-dask certs`` writes a certificate and key for.
ROLES = ("scheduler", "worker", "client")
#: The CA certificate's file name in a credentials directory.
CA_FILE = "ca.pem"


@dataclass(frozen=True)
class Credentials:
    """The three files a party of a TLS cluster needs.

    Attributes
    ----------
    ca_file : str
        The CA certificate(s) the other end must be signed by.
    cert : str
        This party's certificate.
    key : str
        Its private key.
    """

    ca_file: str
    cert: str
    key: str


def credentials_in(directory: str | os.PathLike[str], role: str = "client") -> Credentials:
    """The files of ``role`` in a directory written by :func:`write_credentials`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    base = Path(directory)
    return Credentials(
        str(base / CA_FILE), str(base / f"{role}.pem"), str(base / f"{role}-key.pem")
    )


# -- writing ----------------------------------------------------------------------------------
def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rh-dask cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _private_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(
    subject: str,
    key: Any,
    issuer: Any,
    issuer_key: Any,
    *,
    start: _dt.datetime,
    days: float,
    ca: bool,
    purposes: Sequence[Any] = (),
    hosts: Sequence[str] = (),
) -> Any:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    name = _name(subject)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if issuer is None else issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - _dt.timedelta(minutes=5))  # clocks a little behind
        .not_valid_after(start + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if ca:
        usage = {"key_cert_sign": True, "crl_sign": True, "digital_signature": False}
    else:
        usage = {"key_cert_sign": False, "crl_sign": False, "digital_signature": True}
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(purposes)), False)
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
        names: list[Any] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), False)
    builder = builder.add_extension(
        x509.KeyUsage(
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
            **usage,
        ),
        True,
    )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (never briefly wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _files(directory: Path) -> list[Path]:
    names = [CA_FILE]
    for role in ROLES:
        names += [f"{role}.pem", f"{role}-key.pem"]
    return [directory / name for name in names]


def write_credentials(
    directory: str | os.PathLike[str],
    *,
    hosts: Sequence[str] = (),
    days: float = 365.0,
    existing: str = "refuse",
    start: _dt.datetime | None = None,
) -> list[Path]:
    """Write a new CA and a certificate and key per role (:data:`ROLES`) into ``directory``.

    Parameters
    ----------
    directory : path
        Created (mode 0700) when missing.
    hosts : sequence of str
        Host names and IP addresses the scheduler and workers are reached at,
        written as subject alternative names (``localhost`` and 127.0.0.1
        are always included). Dask does not check them; other TLS tools may.
    days : float
        Validity of every certificate, from now.
    existing : {"refuse", "keep", "replace"}
        What to do when ``directory`` already holds credentials: raise
        :class:`CertificateError`; leave a complete set as it is (its files
        are checked, and a partial set is refused); or write new ones.
    start : datetime, optional
        The moment validity starts (UTC; default: now).

    Returns
    -------
    list of Path
        The CA certificate, then each role's certificate and key.

    Raises
    ------
    CertificateError
        Credentials already there (``existing="refuse"``), a partial or
        broken set with ``existing="keep"``, or ``days`` not positive.
    MissingExtraError
        The ``cryptography`` package is not installed (the ``tls`` extra).
    """
    from .extras import require

    require("cryptography", "tls", "writing TLS certificates")
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if existing not in ("refuse", "keep", "replace"):
        raise ValueError(f"existing must be 'refuse', 'keep' or 'replace', got {existing!r}")
    if not days > 0:
        raise CertificateError(f"certificates must be valid for a positive time, got {days} days")
    base = Path(directory)
    files = _files(base)
    present = [f for f in files if f.exists()]
    if present and existing == "keep":
        if len(present) < len(files):
            missing = ", ".join(f.name for f in files if not f.exists())
            raise CertificateError(f"{base} holds a partial set of credentials (no {missing})")
        for role in ROLES:
            check_credentials(credentials_in(base, role))
        return files
    if present and existing == "refuse":
        raise CertificateError(
            f"{base} already holds credentials ({present[0].name}); choose another "
            "directory, keep them, or replace them (rh-dask certs --keep / --force)"
        )
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o700)
    now = _now() if start is None else start
    ca_key = _private_key()
    ca = _certificate(
        f"rh-dask CA {os.urandom(4).hex()}", ca_key, None, ca_key, start=now, days=days, ca=True
    )
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    purposes = {"scheduler": both, "worker": both, "client": (ExtendedKeyUsageOID.CLIENT_AUTH,)}
    names = list(dict.fromkeys(["localhost", "127.0.0.1", *hosts]))
    pem = serialization.Encoding.PEM
    _write(files[0], ca.public_bytes(pem), 0o644)
    for i, role in enumerate(ROLES):
        key = _private_key()
        cert = _certificate(
            f"rh-dask {role}",
            key,
            ca,
            ca_key,
            start=now,
            days=days,
            ca=False,
            purposes=purposes[role],
            hosts=names if role != "client" else (),
        )
        _write(files[1 + 2 * i], cert.public_bytes(pem), 0o644)
        private = key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write(files[2 + 2 * i], private, 0o600)
    return files


# -- checking ---------------------------------------------------------------------------------
def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise CertificateError(f"{what} {path} cannot be read: {exc.strerror}") from exc


def _validity(cert: Any, path: str, what: str, now: _dt.datetime) -> None:
    if cert.not_valid_after_utc < now:
        day = cert.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")
        raise CertificateError(f"{what} {path} expired on {day}")
    if cert.not_valid_before_utc > now:
        day = cert.not_valid_before_utc.strftime("%Y-%m-%d %H:%M UTC")
        raise CertificateError(f"{what} {path} is not valid before {day}")


def check_credentials(credentials: Credentials, *, now: _dt.datetime | None = None) -> None:
    """Check a party's files: present, readable, valid now, matching, signed by the CA.

    With ``cryptography`` installed every check runs; without it, Python's
    ``ssl`` module loads the files (presence, format, and that the key
    belongs to the certificate), and validity dates and the signature are
    left to the TLS handshake.

    Raises
    ------
    CertificateError
        Naming the file and what is wrong with it.
    """
    ca_bytes = _read(credentials.ca_file, "CA file")
    cert_bytes = _read(credentials.cert, "certificate")
    _read(credentials.key, "private key")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.load_verify_locations(credentials.ca_file)
    except ssl.SSLError as exc:
        raise CertificateError(
            f"CA file {credentials.ca_file} holds no PEM certificate ({exc.reason})"
        ) from exc
    try:
        context.load_cert_chain(credentials.cert, credentials.key)
    except ssl.SSLError as exc:
        if "mismatch" in str(exc).lower():
            problem = f"private key {credentials.key} does not belong to {credentials.cert}"
        else:
            problem = (
                f"certificate {credentials.cert} or private key {credentials.key} cannot be "
                f"loaded ({exc.reason})"
            )
        raise CertificateError(problem) from exc
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
    except ImportError:
        return
    moment = _now() if now is None else now
    cas = x509.load_pem_x509_certificates(ca_bytes)
    cert = x509.load_pem_x509_certificate(cert_bytes)
    for ca in cas:
        _validity(ca, credentials.ca_file, "CA certificate in", moment)
    _validity(cert, credentials.cert, "certificate", moment)
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):  # another issuer, or key type
            continue
    issuer = cert.issuer.rfc4514_string()
    raise CertificateError(
        f"certificate {credentials.cert} was not signed by the CA in {credentials.ca_file} "
        f"(it names {issuer} as its issuer): credentials from another CA"
    )


def security_for(credentials: Credentials, **options: Any) -> Any:
    """A :class:`distributed.security.Security` using ``credentials`` for every role.

    Encryption is required (``require_encryption=True``): plain ``tcp://``
    connections are refused. ``options`` go to ``Security`` as well.
    """
    from distributed.security import Security

    check_credentials(credentials)
    files: dict[str, Any] = {"tls_ca_file": credentials.ca_file}
    for role in ("client", "scheduler", "worker"):
        files[f"tls_{role}_cert"] = credentials.cert
        files[f"tls_{role}_key"] = credentials.key
    return Security(require_encryption=True, **{**files, **options})


def cluster_security(directory: str | os.PathLike[str]) -> Any:
    """A ``Security`` for a cluster started in this process, each role with its own files.

    For ``LocalCluster(protocol="tls://", security=cluster_security(DIR))``:
    the scheduler, the workers and this process's client use their
    certificates from ``DIR`` (:func:`write_credentials`), encryption required.
    """
    from distributed.security import Security

    files: dict[str, Any] = {"tls_ca_file": str(Path(directory) / CA_FILE)}
    for role in ROLES:
        credentials = credentials_in(directory, role)
        check_credentials(credentials)
        files[f"tls_{role}_cert"] = credentials.cert
        files[f"tls_{role}_key"] = credentials.key
    return Security(require_encryption=True, **files)


def scheduler_address(scheduler: str | None, scheduler_file: str | None) -> str | None:
    """The address a command connects to: ``scheduler`` or the one in ``scheduler_file``."""
    if scheduler_file is None:
        return scheduler
    try:
        return str(json.loads(Path(scheduler_file).read_text())["address"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # open_cluster says what is wrong with the file


def client_security(
    address: str | None,
    *,
    tls_dir: str | None = None,
    ca_file: str | None = None,
    cert: str | None = None,
    key: str | None = None,
) -> Any:
    """The client ``Security`` for ``address``, or ``None`` for a plain ``tcp://`` one.

    Credentials come from ``tls_dir`` (its ``ca.pem``, ``client.pem`` and
    ``client-key.pem``), overridden file by file by ``ca_file``, ``cert`` and
    ``key``; without any of these, from dask's own settings
    ``distributed.comm.tls.ca-file``, ``distributed.comm.tls.client.cert``
    and ``distributed.comm.tls.client.key``. They are checked
    (:func:`check_credentials`) before anything connects.

    Raises
    ------
    CertificateError
        A ``tls://`` address without credentials, credentials given for a
        ``tcp://`` address, or a file that fails its check.
    """
    import dask

    given = any(v is not None for v in (tls_dir, ca_file, cert, key))
    tls = address is not None and address.startswith("tls://")
    if not tls and not given:
        return None
    if address is not None and "://" in address and not tls:
        raise CertificateError(
            f"TLS credentials were given but the scheduler address {address} is not "
            f"tls://; use tls://{address.split('://', 1)[1]}"
        )
    if given:
        base = credentials_in(tls_dir) if tls_dir is not None else None
        files = Credentials(
            ca_file or (base.ca_file if base else ""),
            cert or (base.cert if base else ""),
            key or (base.key if base else ""),
        )
        flags = {"--tls-ca-file": files.ca_file, "--tls-cert": files.cert, "--tls-key": files.key}
        missing = [flag for flag, value in flags.items() if not value]
        if missing:
            raise CertificateError(f"TLS needs {', '.join(missing)} too (or --tls-dir DIR)")
    else:
        tls_config = dask.config.get("distributed.comm.tls")
        files = Credentials(
            tls_config.get("ca-file") or "",
            (tls_config.get("client") or {}).get("cert") or "",
            (tls_config.get("client") or {}).get("key") or "",
        )
        if not all((files.ca_file, files.cert, files.key)):
            raise CertificateError(
                f"the scheduler {address} speaks TLS, and no client credentials are "
                "configured: give --tls-dir DIR (or --tls-ca-file, --tls-cert, --tls-key), "
                "or set distributed.comm.tls.ca-file, .client.cert and .client.key"
            )
    from distributed.security import Security

    check_credentials(files)
    return Security(
        tls_ca_file=files.ca_file,
        tls_client_cert=files.cert,
        tls_client_key=files.key,
        require_encryption=True,
    )
