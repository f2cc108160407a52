"""The API client, with credentials found the way kube-proxy finds them.

kube-proxy's `createClient` (cmd/kube-proxy/app/server.go) decides in this order, and so do we:

1. Neither `--kubeconfig` nor `--master`: the pod's service account (`rest.InClusterConfig`):
   `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, the bearer token and CA from
   `/var/run/secrets/kubernetes.io/serviceaccount/{token,ca.crt}`.
2. Otherwise the kubeconfig file if given (its current context), with `--master` replacing the
   cluster's server URL; `--master` alone is a URL without credentials (clientcmd with an empty
   config and a server override).

The service-account token is re-read whenever the file changes (kubelet rotates projected tokens
by swapping a symlink, so size, mtime or inode change). client-go re-reads it at most once a
minute; a stat per request is cheap and never sends a token the kubelet already replaced.

Like client-go, TCP keepalive is on (30 s idle, kubernetes.utils.keepalive), so a watch on a
dead connection fails within minutes instead of hanging. urllib3's own retries are off: the
source's backoff decides when to retry, and its metrics count every attempt.

Requests are paced as client-go paces kube-proxy's (`--kube-api-qps`, `--kube-api-burst`,
`clientConnection.qps/burst`): a token bucket of `burst` tokens refilled at `qps` a second, each
request waiting for its token (`RateLimitedApiClient.call_api`, which every list, watch and Event
write goes through); qps 0 means 5 and burst 0 means 10 (rest.Config's defaults), a negative qps
no limit. The content type is JSON whatever `--kube-api-content-type` says (protobuf, upstream's
default, is not something this client can decode); another value than JSON or protobuf is logged.

Every file is read through agent/readfile.py (regular files only, bounded), the kubeconfig and
the files it names by agent/kube/kubeconfig.py, once, before the client sees them. Failures that
no retry can fix (no credentials at all, a missing or unparsable kubeconfig, a missing CA or
token file) raise `FatalError` naming the file and what is wrong.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s
from kubernetes.config import kube_config
from kubernetes.config.config_exception import ConfigException

from agent.config import Config
from agent.errors import FatalError
from agent.kube.kubeconfig import KubeconfigError, load_kubeconfig
from agent.kube.tokenbucket import TokenBucket
from agent.readfile import read_regular, reason

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
USER_AGENT = "ebpf-kube-proxy/0.1 (linux/amd64) kubernetes-python"
JSON = "application/json"
PROTOBUF = "application/vnd.kubernetes.protobuf"
DEFAULT_QPS = 5.0  # client-go rest.DefaultQPS / DefaultBurst, used for 0
DEFAULT_BURST = 10
_BEARER = "BearerToken"  # the api_key slot the generated client reads (Configuration.auth_settings)
_load_kube_config_from_dict: Any = kube_config.load_kube_config_from_dict  # untyped in the client
# The service account's token is a JWT of a few kilobytes, its CA bundle a few certificates.
MAX_CREDENTIAL_BYTES = 1 << 20


class TokenFile:
    """A bearer token file, re-read when it changes; installs itself as the client's refresh hook."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self.token = ""

    def read(self) -> str:
        """Read now; raises OSError or FatalError (empty file)."""
        st = os.stat(self.path)
        text = read_regular(self.path, MAX_CREDENTIAL_BYTES).decode("utf-8", errors="replace").strip()
        if not text:
            raise FatalError(f"service account token file {self.path} is empty")
        self._stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
        self.token = text
        return text

    def refresh(self, cfg: k8s.Configuration) -> None:
        """Called by the client before every request (Configuration.refresh_api_key_hook)."""
        with self._lock:
            try:
                st = os.stat(self.path)
                stamp = (st.st_mtime_ns, st.st_ino, st.st_size)
                if stamp != self._stamp:
                    old = self.token
                    self.read()
                    if self.token != old:
                        log.info("service account token %s changed; using the new one", self.path)
            except (OSError, FatalError) as exc:
                # Mid-rotation the file can be briefly absent; the old token is still valid.
                log.debug("keeping the current token, cannot re-read %s: %s", self.path, exc)
            cfg.api_key[_BEARER] = self.token
            cfg.api_key_prefix[_BEARER] = "Bearer"


def _set_refresh_hook(cfg: k8s.Configuration, hook: Any) -> None:
    """The client calls `refresh_api_key_hook(cfg)` before each request (typed as None there)."""
    target: Any = cfg
    target.refresh_api_key_hook = hook


def _base_configuration() -> k8s.Configuration:
    cfg = k8s.Configuration()
    cfg.keep_alive = True
    cfg.retries = False
    return cfg


def in_cluster_configuration(
    environ: Mapping[str, str], service_account_dir: str = SERVICE_ACCOUNT_DIR
) -> k8s.Configuration:
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise FatalError(
            "no API server to watch: --kubeconfig and --master are empty and this is not a pod "
            "(KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are unset); pass --kubeconfig FILE "
            "or --master URL, or --services-file FILE to run without an API server"
        )
    token_path = os.path.join(service_account_dir, "token")
    ca_path = os.path.join(service_account_dir, "ca.crt")
    token = TokenFile(token_path)
    try:
        token.read()
    except OSError as exc:
        raise FatalError(
            f"in-cluster credentials: cannot read the service account token {token_path}: "
            f"{reason(exc)}; is automountServiceAccountToken disabled for this pod?"
        ) from exc
    try:
        if not read_regular(ca_path, MAX_CREDENTIAL_BYTES).strip():
            raise FatalError(f"in-cluster credentials: the service account CA {ca_path} is empty")
    except OSError as exc:
        raise FatalError(
            f"in-cluster credentials: cannot read the service account CA {ca_path}: {reason(exc)}"
        ) from exc
    cfg = _base_configuration()
    hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    cfg.host = f"https://{hostport}"
    cfg.ssl_ca_cert = ca_path
    _set_refresh_hook(cfg, token.refresh)
    token.refresh(cfg)
    return cfg


def kubeconfig_configuration(
    path: str, master: str = "", loaded: Mapping[str, Any] | None = None
) -> k8s.Configuration:
    """From the kubeconfig at `path` (`loaded`: what `load_kubeconfig(path)` returned already)."""
    cfg = _base_configuration()
    if path:
        if loaded is None:
            try:
                loaded = load_kubeconfig(path)
            except KubeconfigError as exc:
                raise FatalError(str(exc)) from exc
        try:
            # A copy: the loader keeps and may rewrite what it is given (token refreshes).
            _load_kube_config_from_dict(
                config_dict=copy.deepcopy(dict(loaded)), client_configuration=cfg, persist_config=False
            )
        except (ConfigException, ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise FatalError(f"--kubeconfig {path}: {exc}") from exc
        # load_kube_config copies the loaded settings into `cfg` but not our transport choices.
        cfg.keep_alive = True
        cfg.retries = False
    if master:
        cfg.host = master.rstrip("/")
        loader_hook = cfg.refresh_api_key_hook
        if loader_hook is not None:
            # The kubeconfig loader's token refresh re-applies the whole context, server included,
            # before every request; --master must still win (clientcmd's ConfigOverrides).
            def refresh(c: k8s.Configuration, url: str = cfg.host) -> None:
                loader_hook(c)
                c.host = url

            _set_refresh_hook(cfg, refresh)
    if not cfg.host or cfg.host == "http://localhost":
        raise FatalError(
            f"--kubeconfig {path}: its current context names no cluster server; pass --master URL"
        )
    return cfg


def client_configuration(
    config: Config,
    environ: Mapping[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    kubeconfig: Mapping[str, Any] | None = None,
) -> k8s.Configuration:
    """The client configuration kube-proxy would build from these flags (see the module docstring);
    `kubeconfig`: the file `config.kubeconfig` names, loaded already (`load_kubeconfig`)."""
    if not config.kubeconfig and not config.master:
        return in_cluster_configuration(os.environ if environ is None else environ, service_account_dir)
    return kubeconfig_configuration(config.kubeconfig, config.master, kubeconfig)


class RateLimitedApiClient(k8s.ApiClient):
    """The kubernetes client with client-go's request pacing; `sleep` is injectable for tests."""

    def __init__(
        self,
        configuration: k8s.Configuration,
        bucket: TokenBucket | None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(configuration)
        self.bucket = bucket
        self._sleep = sleep

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if self.bucket is not None:
            wait = self.bucket.reserve()
            if wait > 0:
                self._sleep(wait)
        return super().call_api(*args, **kwargs)


def rate_limit(qps: float, burst: int) -> TokenBucket | None:
    """client-go's rest.Config defaulting: qps 0 = 5, burst 0 = 10, qps < 0 = no limit."""
    qps = qps or DEFAULT_QPS
    if qps < 0:
        return None
    return TokenBucket(qps, burst or DEFAULT_BURST)


def api_client(
    config: Config,
    environ: Mapping[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    sleep: Callable[[float], None] = time.sleep,
    kubeconfig: Mapping[str, Any] | None = None,
) -> k8s.ApiClient:
    """An ApiClient for `config`; raises FatalError when no usable credentials are found.

    Opens no connection: the first request happens when the source or the recorder starts.
    """
    cfg = client_configuration(config, environ, service_account_dir, kubeconfig)
    if config.api_content_type not in (JSON, PROTOBUF):
        log.info(
            "--kube-api-content-type %s: this client reads and writes %s only; using it",
            config.api_content_type,
            JSON,
        )
    api = RateLimitedApiClient(cfg, rate_limit(config.api_qps, config.api_burst), sleep)
    api.user_agent = USER_AGENT
    return api


def describe(api: k8s.ApiClient) -> str:
    """`https://host:port (token|client certificate|no credentials)` for the startup log line."""
    cfg = api.configuration
    if cfg.api_key.get(_BEARER) or cfg.api_key.get("authorization") or cfg.refresh_api_key_hook:
        how = "bearer token"
    elif cfg.cert_file:
        how = "client certificate"
    else:
        how = "no credentials"
    return f"{cfg.host} ({how})"
