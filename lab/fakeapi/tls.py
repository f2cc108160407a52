"""A throwaway CA and a server certificate for 127.0.0.1/localhost, made with the openssl CLI.

The in-cluster path of the agent only speaks https with the service account's CA, as a pod does, so
the fake server needs a certificate its clients can verify. One set is made per test process
(EC P-256 keys: a few milliseconds each) and reused by every TLS server of the run.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path


_lock = threading.Lock()
_certs: Certs | None = None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def server_certs() -> Certs:
    """The process's CA and server certificate (created on first use)."""
    global _certs
    with _lock:
        if _certs is None:
            d = Path(tempfile.mkdtemp(prefix="fakeapi-tls-"))
            atexit.register(shutil.rmtree, d, True)
            ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
            _openssl(
                "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
                "-subj", "/CN=fakeapi-ca",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                cwd=d,
            )  # fmt: skip
            _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=fakeapi", cwd=d)
            (d / "ext.cnf").write_text(
                "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                "extendedKeyUsage=serverAuth\n"
                "keyUsage=critical,digitalSignature\n"
                "authorityKeyIdentifier=keyid,issuer\n"
                "subjectKeyIdentifier=hash\n"
            )
            _openssl(
                "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf",
                cwd=d,
            )  # fmt: skip
            _certs = Certs(d / "ca.crt", d / "server.crt", d / "server.key")
        return _certs
