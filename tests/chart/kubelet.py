"""Start a rendered container the way the kubelet and a container runtime would, for a lab node.

What a pod of the DaemonSet gets, and how a lab run stands in for it:

* **command line**: `command` + `args` exactly as rendered, with `$(VAR)` references expanded
  from the container's environment as the kubelet does (`$$` is a literal `$`; an undefined
  reference stays as written), the downward API resolved (`spec.nodeName` is the lab node's name).
* **environment**: only what the container spec sets plus what the image sets (PATH and
  EKP_BPF_DIR in the Dockerfile; here PATH starts with the repository's virtualenv, which
  stands in for the image's installed agent, and EKP_BPF_DIR is the repository's bpf/; the test
  may add a PYTHONPYCACHEPREFIX holding the byte code the image's pip install would have written).
* **network**: `hostNetwork: true` means the node's network namespace: the process starts under
  `nsenter --net=/run/netns/<node>` (which, unlike `ip netns exec`, leaves /sys alone).
* **filesystem**: a private mount namespace (`unshare --mount --propagation private`) with a
  fresh tmpfs on /run (a container's /run is its own), every `volumeMount` bind-mounted from its
  volume: hostPath volumes from the host path, or from the substitute the test gives for it
  (`hostpaths`, e.g. a per-lab bpffs instead of /sys/fs/bpf), configMap volumes from files
  written with the ConfigMap's data, emptyDir from a fresh directory, and the service-account
  token, CA and namespace at /var/run/secrets/kubernetes.io/serviceaccount as the kubelet
  projects them. `readOnly` mounts are remounted read-only. Unless the container is privileged,
  /proc/sys is remounted read-only too, as runc does for every unprivileged container.
* **capabilities**: unless privileged, the process keeps exactly the container's
  `capabilities.add` (`setpriv --bounding-set`): a missing capability fails here as it would in
  the pod.

What is not reproduced: the image's own filesystem (the host's, with the virtualenv, serves),
seccomp, cgroup limits, and the kubelet's restarts.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion (third_party/forked/golang/expansion): `$$` -> `$`,
    `$(NAME)` -> its value when NAME is defined, else left as it is."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


@dataclass(frozen=True)
class PodFacts:
    """What the downward API may ask about the pod."""

    node_name: str
    host_ip: str
    namespace: str = "kube-system"
    service_account: str = "default"


def container_env(container: Mapping[str, Any], pod: PodFacts) -> dict[str, str]:
    """The container's environment from its `env` list, in order (later entries may refer to
    earlier ones); `valueFrom.fieldRef` answered from `pod`."""
    fields = {
        "spec.nodeName": pod.node_name,
        "status.hostIP": pod.host_ip,
        "status.podIP": pod.host_ip,  # hostNetwork: the pod's IP is the node's
        "metadata.namespace": pod.namespace,
        "spec.serviceAccountName": pod.service_account,
    }
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"env {item['name']}: this stand-in resolves only value and fieldRef")
    return env


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    return [expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]]


def capabilities(container: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The capabilities the container keeps; None when privileged (all of them)."""
    sc = container.get("securityContext", {})
    if sc.get("privileged"):
        return None
    caps = sc.get("capabilities", {})
    assert caps.get("drop") == ["ALL"], "the chart drops every default capability"
    return tuple(caps.get("add", []))


@dataclass
class Launch:
    """Everything needed to start one rendered container for a lab node."""

    argv: list[str]  # the full command to hand to Popen
    env: dict[str, str]  # the container's environment (image + spec)
    command: list[str]  # the container's own command line, as the runtime would exec it
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (source, target, read-only)


def launch(
    pod_spec: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    pod: PodFacts,
    netns: str,
    workdir: Path,
    hostpaths: Mapping[str, str],
    config_maps: Mapping[str, Mapping[str, str]],
    service_account: Mapping[str, bytes],
    image_env: Mapping[str, str],
    image_dirs: Sequence[str] = (),
) -> Launch:
    """The argv that starts `container` of `pod_spec` as described in the module docstring.

    `image_dirs` are directories of the machine that stand in for the image's own files (the
    repository and its virtualenv): visible in the container even where a volume (the /tmp
    emptyDir, when the repository lives under /tmp) would cover them.

    `hostpaths` maps a hostPath volume's path to what stands in for it (paths not listed are
    used as they are); `config_maps` maps a ConfigMap name to its data; `service_account` holds
    the projected token, ca.crt and namespace. Files are written under `workdir`.
    """
    env = dict(image_env)
    env.update(container_env(container, pod))
    command = command_line(container, env)
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts: list[tuple[str, str, bool]] = []
    workdir.mkdir(parents=True, exist_ok=True)
    for vm in container.get("volumeMounts", []):
        vol = volumes[vm["name"]]
        if "hostPath" in vol:
            path = vol["hostPath"]["path"]
            source = hostpaths.get(path, path)
            make_hostpath(source, vol["hostPath"].get("type", ""))
        elif "configMap" in vol:
            d = workdir / f"configmap-{vm['name']}"
            d.mkdir(exist_ok=True)
            for key, text in config_maps[vol["configMap"]["name"]].items():
                (d / key).write_text(text)
            source = str(d)
        elif "emptyDir" in vol:
            d = workdir / f"emptydir-{vm['name']}"
            d.mkdir(exist_ok=True)
            source = str(d)
        else:
            raise AssertionError(f"volume {vm['name']}: this stand-in knows hostPath, configMap, emptyDir")
        mounts.append((source, vm["mountPath"], bool(vm.get("readOnly"))))
    if pod_spec.get("automountServiceAccountToken", True):
        sa = workdir / "serviceaccount"
        sa.mkdir(exist_ok=True)
        for name, data in service_account.items():
            (sa / name).write_bytes(data)
        mounts.append((str(sa), SERVICE_ACCOUNT_DIR, True))
    caps = capabilities(container)
    script = _mount_script(mounts, workdir, read_only_proc_sys=caps is not None, image_dirs=image_dirs)
    exec_argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *command]
    if caps is not None:
        bounding = ",".join(["-all", *(f"+{c.lower()}" for c in caps)])
        exec_argv = ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "--", *exec_argv]
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "--",
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-ec",
        script + ' exec "$@"',
        "container",
        *exec_argv,
    ]
    return Launch(argv, env, command, mounts)


def make_hostpath(path: str, kind: str) -> None:
    """The kubelet's DirectoryOrCreate (mode 0755) and FileOrCreate (0644); other types must exist."""
    if kind == "DirectoryOrCreate" and not os.path.exists(path):
        os.makedirs(path, 0o755)
    elif kind == "FileOrCreate" and not os.path.exists(path):
        Path(path).touch(0o644)
    assert os.path.exists(path), f"hostPath {path} ({kind or 'no type'}) does not exist"


def _under_run(path: str) -> bool:
    return path == "/run" or path.startswith(("/run/", "/var/run/"))


def _mount_script(
    mounts: Sequence[tuple[str, str, bool]],
    workdir: Path,
    *,
    read_only_proc_sys: bool,
    image_dirs: Sequence[str] = (),
) -> str:
    """Shell run inside the new mount namespace before the container's command is exec'd.

    The host's /run is bind-mounted aside first, so host paths under /run (the xtables lock,
    the agent's lock directory) stay reachable after /run becomes the container's own tmpfs.
    A mount point missing on the host outside /run (/etc/ebpf-kube-proxy) is made in an overlay
    of its nearest existing parent, so the host's own directories are never written.
    """
    stage = workdir / "host-run"
    stage.mkdir(exist_ok=True)
    q = shlex.quote
    lines = [f"mount --bind /run {q(str(stage))}", "mount -t tmpfs -o mode=0755 tmpfs /run"]
    # The image's directories, set aside on the container's /run (no volume covers it) to be put
    # back over whatever volume hides them.
    hidden = [
        d
        for d in image_dirs
        if any(d == t or d.startswith(t.rstrip("/") + "/") for _, t, _ in mounts if not _under_run(t))
    ]
    for i, d in enumerate(hidden):
        lines += [f"mkdir -p /run/.image-{i}", f"mount --bind {q(d)} /run/.image-{i}"]
    overlaid: list[str] = []
    for _, target, _ in mounts:
        if _under_run(target) or os.path.exists(target):
            continue
        parent = os.path.dirname(target)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        assert parent != "/", f"cannot stand in for a container mount point at {target} (under /)"
        if parent in overlaid:
            continue
        ovl = workdir / f"overlay-{len(overlaid)}"
        (ovl / "upper").mkdir(parents=True, exist_ok=True)
        (ovl / "work").mkdir(exist_ok=True)
        opts = f"lowerdir={parent},upperdir={ovl / 'upper'},workdir={ovl / 'work'}"
        lines.append(f"mount -t overlay overlay -o {q(opts)} {q(parent)}")
        overlaid.append(parent)

    # A mount that hides the source of another (the /tmp emptyDir over a work dir in /tmp) goes last.
    def hides_a_source(m: tuple[str, str, bool]) -> bool:
        return any(src.startswith(m[1].rstrip("/") + "/") for src, _, _ in mounts) or str(workdir).startswith(
            m[1].rstrip("/") + "/"
        )

    for source, target, read_only in sorted(mounts, key=hides_a_source):
        src = str(stage / os.path.relpath(source, "/run")) if source.startswith("/run/") else source
        if os.path.isdir(source):
            lines.append(f"mkdir -p {q(target)}")
        else:
            lines.append(f"mkdir -p {q(os.path.dirname(target))} && touch {q(target)}")
        lines.append(f"mount --bind {q(src)} {q(target)}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {q(target)}")
    for i, d in enumerate(hidden):
        lines += [f"mkdir -p {q(d)}", f"mount --bind /run/.image-{i} {q(d)}"]
    if read_only_proc_sys:
        lines += ["mount --bind /proc/sys /proc/sys", "mount -o remount,bind,ro /proc/sys"]
    return "; ".join(lines) + ";"
