"""TLS: the credentials helper, its checks, TLS clusters, and local clusters staying local.

The helper (``rh-dask certs``) needs ``cryptography``, which the dev extra
(and so CI's lock) installs; ``importorskip`` only guards environments
without it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import re
import stat
import time
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest

from rh_dask import RenewableHuberRegressor
from rh_dask.app.cli import EXIT_CLUSTER, EXIT_OK, main
from rh_dask.app.cluster import ClusterError, open_cluster
from rh_dask.datasets import StreamSpec

cryptography = pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID  # noqa: E402

from rh_dask.app.security import (  # noqa: E402
    ROLES,
    CertificateError,
    Credentials,
    check_credentials,
    client_security,
    credentials_in,
    security_for,
    write_credentials,
)

UTC = dt.timezone.utc


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "certs"
    write_credentials(directory)
    return directory


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tls-other") / "certs"
    write_credentials(directory)
    return directory


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("rh-dask: error: "), err
    return lines[0]


# -- the helper -------------------------------------------------------------------------------
def test_certs_command_writes_a_ca_and_a_certificate_per_role(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", str(out), "--host", "scheduler", "--host", "10.0.0.7"]) == EXIT_OK
    assert "the CA's private key was not kept" in capsys.readouterr().out
    names = {"ca.pem"} | {f"{r}.pem" for r in ROLES} | {f"{r}-key.pem" for r in ROLES}
    assert {p.name for p in out.iterdir()} == names  # no CA key among them
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ROLES:
        assert stat.S_IMODE((out / f"{role}-key.pem").stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate((out / f"{role}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        purposes = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.CLIENT_AUTH in purposes
        # The client is never a server; the scheduler and workers are both.
        assert (ExtendedKeyUsageOID.SERVER_AUTH in purposes) == (role != "client")
        lifetime = cert.not_valid_after_utc - dt.datetime.now(UTC)
        assert dt.timedelta(days=364) < lifetime <= dt.timedelta(days=365)
        check_credentials(credentials_in(out, role))
    san = x509.load_pem_x509_certificate((out / "scheduler.pem").read_bytes())
    names = san.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "scheduler"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.0.0.7",
    }


def test_certs_command_refuses_to_overwrite_and_keeps_or_replaces_on_request(tmp_path, capsys):
    out = tmp_path / "certs"
    assert main(["certs", str(out)]) == EXIT_OK
    first = (out / "ca.pem").read_bytes()
    capsys.readouterr()
    assert main(["certs", str(out)]) == EXIT_CLUSTER
    assert "already holds credentials" in _one_error_line(capsys)
    assert (out / "ca.pem").read_bytes() == first
    assert main(["certs", str(out), "--keep"]) == EXIT_OK
    assert "kept TLS credentials" in capsys.readouterr().out
    assert (out / "ca.pem").read_bytes() == first
    assert main(["certs", str(out), "--force"]) == EXIT_OK
    assert (out / "ca.pem").read_bytes() != first
    (out / "worker-key.pem").unlink()
    capsys.readouterr()
    assert main(["certs", str(out), "--keep"]) == EXIT_CLUSTER
    assert "partial set of credentials (no worker-key.pem)" in _one_error_line(capsys)


# -- the checks -------------------------------------------------------------------------------
def test_check_names_a_missing_file_a_foreign_key_another_ca_and_garbage(
    creds, other_ca, tmp_path
):
    client = credentials_in(creds)
    gone = Credentials(client.ca_file, str(tmp_path / "nope.pem"), client.key)
    with pytest.raises(CertificateError, match=r"certificate .*nope\.pem does not exist"):
        check_credentials(gone)
    foreign_key = Credentials(client.ca_file, client.cert, credentials_in(creds, "worker").key)
    with pytest.raises(CertificateError, match=r"worker-key\.pem does not belong to .*client"):
        check_credentials(foreign_key)
    foreign_ca = Credentials(credentials_in(other_ca).ca_file, client.cert, client.key)
    with pytest.raises(CertificateError, match=r"not signed by the CA .*another CA"):
        check_credentials(foreign_ca)
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(CertificateError, match="holds no PEM certificate"):
        check_credentials(Credentials(str(garbage), client.cert, client.key))


def test_check_names_expired_and_not_yet_valid_certificates(tmp_path):
    now = dt.datetime.now(UTC)
    old = tmp_path / "old"
    write_credentials(old, start=now - dt.timedelta(days=40), days=30)
    with pytest.raises(CertificateError, match=r"ca\.pem expired on \d{4}-\d\d-\d\d"):
        check_credentials(credentials_in(old))
    future = tmp_path / "future"
    write_credentials(future, start=now + dt.timedelta(days=3), days=30)
    with pytest.raises(CertificateError, match="is not valid before"):
        check_credentials(credentials_in(future))
    # The certificate alone expired (the CA still valid), seen from a later moment.
    fresh = tmp_path / "fresh"
    write_credentials(fresh, days=10)
    later = now + dt.timedelta(days=11)
    with pytest.raises(CertificateError, match="expired"):
        check_credentials(credentials_in(fresh), now=later)


def test_client_security_needs_credentials_for_tls_and_tls_for_credentials(creds):
    assert client_security("tcp://10.0.0.1:8786") is None
    assert client_security(None) is None
    with pytest.raises(CertificateError, match="no client credentials are configured"):
        client_security("tls://10.0.0.1:8786")
    with pytest.raises(CertificateError, match=r"is not tls://; use tls://10\.0\.0\.1:8786"):
        client_security("tcp://10.0.0.1:8786", tls_dir=str(creds))
    with pytest.raises(CertificateError, match="needs --tls-cert, --tls-key too"):
        client_security("tls://h:1", ca_file=str(creds / "ca.pem"))
    security = client_security("tls://h:1", tls_dir=str(creds))
    assert security.require_encryption
    assert security.tls_client_cert == str(creds / "client.pem")
    # dask's own settings are the default.
    settings = {
        "distributed.comm.tls.ca-file": str(creds / "ca.pem"),
        "distributed.comm.tls.client.cert": str(creds / "client.pem"),
        "distributed.comm.tls.client.key": str(creds / "client-key.pem"),
    }
    with dask.config.set(settings):
        assert client_security("tls://h:1").tls_client_key == str(creds / "client-key.pem")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls-dir", "{missing}"], r"CA file .*missing/ca\.pem does not exist"),
        (["--tls-dir", "{creds}", "--tls-ca-file", "{other}"], "another CA"),
        (["--tls-dir", "{expired}"], "expired on"),
        ([], "speaks TLS, and no client credentials are configured"),
    ],
)
def test_fit_refuses_bad_credentials_in_one_line_before_connecting(
    flags, message, creds, other_ca, tmp_path, capsys
):
    expired = tmp_path / "expired"
    write_credentials(expired, start=dt.datetime.now(UTC) - dt.timedelta(days=9), days=8)
    values = {
        "missing": str(tmp_path / "missing"),
        "creds": str(creds),
        "other": str(other_ca / "ca.pem"),
        "expired": str(expired),
    }
    data = tmp_path / "x.csv"
    pd.DataFrame({"a": [1.0, 2.0, 3.0], "y": [1.0, 2.0, 4.0]}).to_csv(data, index=False)
    start = time.perf_counter()
    # Port 9 (discard) on 127.0.0.1: nothing answers, and nothing must be tried.
    code = main(
        ["fit", "--input", str(data), "--target", "y", "--output", str(tmp_path / "m.npz")]
        + ["--scheduler", "tls://127.0.0.1:9", "--connect-timeout", "30"]
        + [f.format(**values) for f in flags]
    )
    assert code == EXIT_CLUSTER
    assert time.perf_counter() - start < 5
    line = _one_error_line(capsys)
    assert re.search(message, line), line


def test_tls_options_are_refused_for_a_cluster_the_command_starts(creds, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tls-dir", str(creds)])
    assert exit_info.value.code == 2
    assert "--tls-dir is for a scheduler of its own" in capsys.readouterr().err


# -- TLS clusters -----------------------------------------------------------------------------
def _stream(n_chunks: int = 6, rows: int = 300):
    spec = StreamSpec(n_features=4, seed=5)
    parts = [spec.chunk(i, rows) for i in range(n_chunks)]
    X = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return da.from_array(X, chunks=(rows, 4)), da.from_array(y, chunks=rows)


def _fit_on(cluster, security=None) -> RenewableHuberRegressor:
    from distributed import Client

    X, y = _stream()
    with Client(cluster, security=security, set_as_default=False) as client:
        with client.as_current():
            return RenewableHuberRegressor(progress=False, lookahead=2).fit(X, y)


@pytest.fixture
def tls_cluster(creds):
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=False,
        protocol="tls://",
        security=security_for(credentials_in(creds, "scheduler")),
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.CRITICAL,
    ) as cluster:
        yield cluster


@pytest.mark.slow
def test_tls_cluster_fits_bit_identically_to_plain_tcp(tls_cluster, creds):
    from distributed import LocalCluster

    assert tls_cluster.scheduler_address.startswith("tls://127.0.0.1:")
    assert all(a.startswith("tls://") for a in tls_cluster.scheduler.workers)
    secure = _fit_on(tls_cluster, client_security(tls_cluster.scheduler_address, tls_dir=creds))
    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=False,
        protocol="tcp://",
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.CRITICAL,
    ) as plain:
        assert plain.scheduler_address.startswith("tcp://")
        reference = _fit_on(plain)
    assert secure.placement_["worker"].startswith("tls://")
    np.testing.assert_array_equal(secure.coef_, reference.coef_)
    assert secure.intercept_ == reference.intercept_
    np.testing.assert_array_equal(secure.state_.information, reference.state_.information)


async def _connect(address: str, security) -> None:
    from distributed.comm import connect

    comm = await connect(address, timeout=5, **security.get_connection_args("client"))
    await comm.close()


@pytest.mark.slow
def test_tls_cluster_refuses_no_credentials_another_ca_and_plain_tcp(tls_cluster, other_ca):
    from distributed.security import Security

    address = tls_cluster.scheduler_address
    # The command line's connect names the problem, at once rather than at the timeout.
    start = time.perf_counter()
    foreign = client_security(address, tls_dir=other_ca)
    with pytest.raises(CertificateError, match="did not accept each other's certificates"):
        open_cluster(address, timeout=20, security=foreign)
    plain = "tcp://" + address.split("://", 1)[1]
    with pytest.raises(ClusterError, match="refuses plain tcp://; use tls://"):
        open_cluster(plain, timeout=20)
    assert time.perf_counter() - start < 10
    # Dask's own connect: another CA's credentials, or none, never get through.
    with pytest.raises(OSError, match="TLS certificate does not match"):
        asyncio.run(_connect(address, foreign))
    with pytest.raises(TypeError, match="TLS expects a `ssl_context`"):
        asyncio.run(_connect(address, Security()))


@pytest.mark.slow
def test_cli_fits_against_a_tls_scheduler_with_tls_dir_and_with_dask_settings(
    tls_cluster, creds, tmp_path, capsys
):
    data = tmp_path / "data.csv"
    spec = StreamSpec(n_features=3, seed=2)
    X, y = spec.chunk(0, 400)
    pd.DataFrame(X, columns=["a", "b", "c"]).assign(y=y).to_csv(data, index=False)
    fit = ["fit", "--input", str(data), "--target", "y", "--no-progress"]
    fit += ["--scheduler", tls_cluster.scheduler_address, "--connect-timeout", "20"]
    assert main([*fit, "--output", str(tmp_path / "a.npz"), "--tls-dir", str(creds)]) == 0
    assert f"cluster: remote at {tls_cluster.scheduler_address}" in capsys.readouterr().out
    settings = {
        "distributed.comm.tls.ca-file": str(creds / "ca.pem"),
        "distributed.comm.tls.client.cert": str(creds / "client.pem"),
        "distributed.comm.tls.client.key": str(creds / "client-key.pem"),
    }
    with dask.config.set(settings):
        assert main([*fit, "--output", str(tmp_path / "b.npz")]) == 0
    a = RenewableHuberRegressor.load(tmp_path / "a.npz")
    b = RenewableHuberRegressor.load(tmp_path / "b.npz")
    np.testing.assert_array_equal(a.coef_, b.coef_)


# -- local clusters stay local ----------------------------------------------------------------
def _bound_hosts(server) -> set[str]:
    return {s.getsockname()[0] for s in server.http_server._sockets.values()}


def _worker_http_hosts(dask_worker) -> list[str]:
    return sorted({s.getsockname()[0] for s in dask_worker.http_server._sockets.values()})


@pytest.mark.slow
@pytest.mark.parametrize("dashboard", [None, ":0"])
def test_the_default_local_cluster_listens_on_127_0_0_1_only(dashboard):
    # The cluster of `rh-dask demo` and `--scheduler local` (worker processes, as there).
    with open_cluster("local", n_workers=1, threads_per_worker=1, dashboard=dashboard) as s:
        assert s.kind in ("local", "local-cuda")
        assert s.address.startswith("tcp://127.0.0.1:")
        workers = s.workers()
        assert workers and all(w["address"].startswith("tcp://127.0.0.1:") for w in workers)
        assert _bound_hosts(s.cluster.scheduler) == {"127.0.0.1"}
        hosts = s.client.run(_worker_http_hosts)
        assert all(h == ["127.0.0.1"] for h in hosts.values()), hosts
        if dashboard is not None:
            assert s.dashboard_link.startswith("http://127.0.0.1:")


def test_a_dashboard_given_only_a_port_is_bound_to_localhost():
    from rh_dask.app.cluster import _dashboard_options

    assert _dashboard_options(":8787")["dashboard_address"] == "127.0.0.1:8787"
    assert _dashboard_options("8787")["dashboard_address"] == "127.0.0.1:8787"
    assert _dashboard_options("0.0.0.0:8787")["dashboard_address"] == "0.0.0.0:8787"
    assert _dashboard_options(None)["scheduler_kwargs"]["dashboard_address"] == "127.0.0.1:0"


def test_credentials_files_are_private_even_under_a_permissive_umask(tmp_path):
    previous = os.umask(0)
    try:
        write_credentials(tmp_path / "c")
    finally:
        os.umask(previous)
    for role in ROLES:
        assert stat.S_IMODE((tmp_path / "c" / f"{role}-key.pem").stat().st_mode) == 0o600
