"""A lab cluster whose agents follow a fake API server, as they would a real one.

The fake kube-apiserver (lab/fakeapi) listens on the host's loopback, where the agents (run in
the host namespace, programming their node's namespace with `--netns`) reach it through a
kubeconfig. Tests change the cluster with `apply` / `delete` on the server and wait until every
agent logged a sync that includes the server's latest resourceVersion: no sleeps, no guessing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lab import Lab
from lab.fakeapi import FakeApiServer
from lab.fakeapi.objects import node as node_object
from lab.harness import Agent, Cluster


class ApiCluster(Cluster):
    """A lab plus one agent per node following `server`; `apply` adds or changes objects."""

    def __init__(self, lab: Lab, mode: str, extra: Sequence[str] = ()) -> None:
        assert lab.tmpdir is not None
        self.server = FakeApiServer(bookmark_interval_s=1.0)
        self.kubeconfig = lab.tmpdir / "kubeconfig"
        super().__init__(lab, mode, extra=extra)
        self.agents = [Agent(lab, n, mode, [f"--kubeconfig={self.kubeconfig}"], extra) for n in lab.nodes]

    def start(self) -> None:
        self.server.start()
        self.server.write_kubeconfig(self.kubeconfig)
        wanted = self._record(
            [self.server.apply(node_object(n.name, n.ip, pod_cidr=n.pod_cidr)) for n in self.lab.nodes]
        )
        for a in self.agents:
            a.start()
        self.wait_synced(wanted)

    def stop(self) -> list[str]:
        try:
            return super().stop()
        finally:
            self.server.stop()

    @staticmethod
    def _record(written: Iterable[Mapping[str, Any]]) -> dict[str, int]:
        """The resourceVersion per kind each agent must reach to include `written`."""
        wanted: dict[str, int] = {}
        for obj in written:
            rv = int(obj["metadata"]["resourceVersion"])
            wanted[obj["kind"]] = max(wanted.get(obj["kind"], 0), rv)
        return wanted

    def wait_synced(self, wanted: Mapping[str, int], timeout: float = 60.0) -> None:
        """Until every agent programmed the given resourceVersions of each kind."""
        for a in self.agents:
            a.wait_resource_versions(wanted, timeout)

    def apply_nowait(self, objects: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """Create or change each object (as `kubectl apply`) without waiting; what `wait_synced`
        then waits for."""
        return self._record([self.server.apply(obj) for obj in objects])

    def apply(self, objects: Sequence[Mapping[str, Any]], timeout: float = 60.0) -> None:
        """Create or change each object (as `kubectl apply`), then wait for the agents."""
        self.wait_synced(self.apply_nowait(objects), timeout)

    def delete(self, objects: Iterable[Mapping[str, Any]], timeout: float = 60.0) -> None:
        gone = []
        for obj in objects:
            meta = obj["metadata"]
            gone.append(
                self.server.delete(
                    obj["kind"], meta.get("namespace", ""), meta["name"], obj.get("apiVersion")
                )
            )
        self.wait_synced(self._record(gone), timeout)
