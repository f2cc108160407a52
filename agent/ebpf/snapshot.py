"""The planner of the last run, kept across a restart so that the next start need not rebuild it.

A restart over pinned maps otherwise reads every entry back, re-adopts the kernel's ids and plans
every service port again only to find it wrote nothing (about 0.8 CPU s of a restart at 10,000
Services of 10 endpoints). At a clean stop (`EbpfProxier.close`) the planner, when the maps hold
exactly what it desired (their read-back decoded and compared), is written to one file next to
the agent's lock files (/run/ebpf-kube-proxy: tmpfs, root only, gone at reboot, the chart's
hostPath), with a digest of each service map's raw read-back. The next start reads its maps back
anyway (batch lookups in the kernel) and takes the planner only when every digest still matches
that read-back byte for byte: the maps hold what the planner believes, so it carries on as the
last run would have at its next full resync, and its first `update` skips every service port
whose Service and endpoints are as planned. Anything else falls back to the read-back path:

* no file, a file from another agent build or other flags (`_identity`: the format, the Python,
  the agent's own source, the config), a file whose body does not match its checksum (truncated,
  corrupted), one that does not unpickle into the planner's own types;
* a map that holds anything else, or the same entries in another order (a write since, by anyone:
  the kernel's batch order of an unchanged map is stable; a rewrite of the same entries only
  costs the fallback).

The file is consumed (removed) by the start that reads it, whatever the outcome, so a later start
after a crash never meets it (nor any partial file a stop killed while writing it left). The body
is a pickle, read by an unpickler that builds only the planner's own classes (`_Restricted`): the
directory is root's alone, and even so a file put there cannot run code. The collector is held
while the pickle is built or read: a third of a million objects would otherwise trigger
collections that find nothing to free (0.8 s against 0.15 s of loading at 10,000 Services).
"""

from __future__ import annotations

import gc
import glob
import hashlib
import io
import logging
import os
import pickle
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from agent.config import Config
from agent.ebpf.entries import from_dump
from agent.ebpf.planner import ROLES, Planner

log = logging.getLogger(__name__)

_MAGIC = b"EKP-PLANNER-1\n"
_HASH = 32  # sha256
_AGENT_DIR = Path(__file__).resolve().parent.parent
# What the pickle may build: the planner's own state types, nothing callable beyond them.
_ALLOWED = {
    ("agent.config", "NodeContext"),
    ("agent.ebpf.backends", "Backends"),
    ("agent.ebpf.ids", "IdPool"),
    ("agent.ebpf.planner", "Fragment"),
    ("agent.localdetect", "LocalDetector"),
    ("agent.localdetect", "LocalMode"),
    ("agent.model.types", "Endpoint"),
    ("agent.model.types", "Protocol"),
    ("agent.model.types", "ServiceEndpoints"),
    ("agent.model.types", "ServicePort"),
    ("agent.model.types", "ServicePortName"),
    ("agent.model.types", "SessionAffinity"),
}
_NOT_KEPT = ("_config", "_ip")  # the new run's own


def snapshot_path(directory: str, pin_path: str) -> str:
    """One file per pin path (resolved, as agent.lock names the pin path's lock file)."""
    digest = hashlib.sha256(os.path.realpath(pin_path).encode()).hexdigest()[:16]
    return os.path.join(directory, f"planner-{digest}.pickle")


def map_digests(dump: Mapping[str, tuple[bytes, bytes]]) -> bytes:
    """One sha256 per service map of its raw read-back (keys, then values), in ROLES order."""
    out = []
    for role in ROLES:
        keys, values = dump.get(role, (b"", b""))
        h = hashlib.sha256(len(keys).to_bytes(8, "little"))
        h.update(keys)
        h.update(values)
        out.append(h.digest())
    return b"".join(out)


def save(path: str, planner: Planner, dump: Mapping[str, tuple[bytes, bytes]], config: Config) -> str:
    """Write `planner` to `path` if `dump` (the maps' read-back now) holds exactly its desired
    entries; "" when written, else why not (for the log). Atomic: a new file renamed over."""
    if not planner.in_sync:
        return "the planner has writes the maps have not taken"
    for role in ROLES:
        if from_dump(role, *dump.get(role, (b"", b""))) != planner.desired[role]:
            return f"the {role} map holds other entries than the planner desired"
    state = {k: v for k, v in planner.__dict__.items() if k not in _NOT_KEPT}
    with _collector_held():
        body = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    header = _MAGIC + _identity(config) + map_digests(dump) + hashlib.sha256(body).digest()
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return ""


def take(path: str, dump: Mapping[str, tuple[bytes, bytes]], config: Config) -> tuple[Planner | None, str]:
    """The planner saved at `path` if the maps (`dump`) still hold what it desired, and the file
    removed either way. (None, why not) otherwise; (None, "") when there was no file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot read it: {exc}"
    finally:
        with suppress(OSError):
            os.unlink(path)
        for partial in glob.glob(glob.escape(path) + ".*.tmp"):  # a stop killed while it wrote
            with suppress(OSError):
                os.unlink(partial)
    view = memoryview(data)
    at = len(_MAGIC)
    ident, digests, check = (
        view[at : at + _HASH],
        view[at + _HASH : at + _HASH * (1 + len(ROLES))],
        view[at + _HASH * (1 + len(ROLES)) : at + _HASH * (2 + len(ROLES))],
    )
    body = view[at + _HASH * (2 + len(ROLES)) :]
    if view[:at] != _MAGIC or len(check) != _HASH:
        return None, "not a planner snapshot of this format"
    if ident != _identity(config):
        return None, "written by another agent build or with other flags"
    if digests != map_digests(dump):
        return None, "the maps changed since it was written"
    if hashlib.sha256(body).digest() != check:
        return None, "its body does not match its checksum (truncated or corrupted)"
    try:
        with _collector_held():
            state = _Restricted(io.BytesIO(body)).load()
    except Exception as exc:
        return None, f"cannot be read back: {exc}"
    planner = Planner(config)
    if not isinstance(state, dict) or set(state) != set(planner.__dict__) - set(_NOT_KEPT):
        return None, "it does not hold this planner's state"
    planner.__dict__.update(state)
    if not planner.in_sync:
        return None, "it holds writes the maps had not taken"
    return planner, ""


def remove(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a planner's state")
        return super().find_class(module, name)


@contextmanager
def _collector_held() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_identity_cache: dict[str, bytes] = {}


def _identity(config: Config) -> bytes:
    """What a snapshot is only good for: this format, this Python, this agent's source, these flags."""
    code = _identity_cache.get("code")
    if code is None:
        h = hashlib.sha256()
        for file in sorted(_AGENT_DIR.rglob("*.py")):
            h.update(str(file.relative_to(_AGENT_DIR)).encode() + b"\0")
            h.update(file.read_bytes())
        code = _identity_cache["code"] = h.digest()
    return hashlib.sha256(_MAGIC + sys.version.encode() + code + repr(config).encode()).digest()
