"""`merge_slices` against kube-proxy's rule written out plainly (the straightforward form it had
before it was made faster for 10,000 Services): slices in (namespace, service, name) order, one
endpoint per `ip:port` (`[ip]:port` for IPv6) preferring the copy on this node, each port's
endpoints sorted by that string."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import IPFamily, Protocol, ServicePortName
from agent.model.parse import ParsedSlice, SlicePort
from agent.model.tracker import merge_slices
from agent.model.types import Endpoint


def reference(slices: list[ParsedSlice], node_name: str) -> dict[ServicePortName, tuple[Endpoint, ...]]:
    by_port: dict[ServicePortName, dict[str, Endpoint]] = {}
    for sl in sorted(slices, key=lambda s: (s.namespace, s.service, s.name)):
        for port in sl.ports:
            spn = ServicePortName(sl.namespace, sl.service, port.name, port.protocol)
            seen = by_port.setdefault(spn, {})
            for ep in sl.endpoints:
                local = bool(node_name) and ep.node_name == node_name
                key = f"[{ep.ip}]:{port.port}" if sl.family is IPFamily.IPv6 else f"{ep.ip}:{port.port}"
                if key not in seen or local:
                    seen[key] = ep._replace(port=port.port, is_local=local)
    return {spn: tuple(eps[k] for k in sorted(eps)) for spn, eps in by_port.items()}


# Few distinct values, so that duplicates, shared ports and prefixes ("10.0.0.1" / "10.0.0.10")
# are common.
IPS4 = ["10.0.0.1", "10.0.0.10", "10.0.0.2", "10.0.1.1", "9.0.0.1"]
IPS6 = ["fd00::1", "fd00::10", "fd00::2", "fd00::a"]
endpoints = st.builds(
    Endpoint,
    ip=st.sampled_from(IPS4 + IPS6),
    port=st.sampled_from([0, 80, 8080]),
    ready=st.booleans(),
    node_name=st.sampled_from(["", "node1", "node2"]),
    is_local=st.booleans(),
)
slice_ports = st.builds(
    SlicePort,
    name=st.sampled_from(["", "http"]),
    port=st.sampled_from([80, 8080, 9]),
    protocol=st.just(Protocol.TCP),
)
slices = st.builds(
    ParsedSlice,
    namespace=st.sampled_from(["a", "b"]),
    name=st.sampled_from(["s-1", "s-2", "s-10"]),
    service=st.sampled_from(["web", "db"]),
    ports=st.lists(slice_ports, max_size=3).map(tuple),
    endpoints=st.lists(endpoints, max_size=6).map(tuple),
    family=st.sampled_from([IPFamily.IPv4, IPFamily.IPv6]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(slices, max_size=4), st.sampled_from(["", "node1"]))
def test_merge_slices_is_kube_proxys_merge(given_slices: list[ParsedSlice], node_name: str) -> None:
    got = merge_slices(iter(given_slices), node_name)
    want = reference(given_slices, node_name)
    assert got == want
    assert all(type(ep) is Endpoint for eps in got.values() for ep in eps)


def test_endpoints_sort_by_their_ip_port_string_not_by_address() -> None:
    sl = ParsedSlice(
        "a",
        "s-1",
        "web",
        (SlicePort("", 80, Protocol.TCP),),
        (Endpoint("10.0.0.2", 0), Endpoint("10.0.0.1", 0), Endpoint("10.0.0.10", 0)),
    )
    (eps,) = merge_slices([sl], "").values()
    # ":" sorts after the digits: "10.0.0.10:80" < "10.0.0.1:80" < "10.0.0.2:80", as in kube-proxy.
    assert [e.ip for e in eps] == ["10.0.0.10", "10.0.0.1", "10.0.0.2"]


def test_a_later_slices_local_copy_of_an_endpoint_wins_and_an_earlier_one_is_kept_otherwise() -> None:
    port = (SlicePort("", 80, Protocol.TCP),)
    remote = ParsedSlice("a", "s-1", "web", port, (Endpoint("10.0.0.1", 0, node_name="node2", zone="z1"),))
    local = ParsedSlice("a", "s-2", "web", port, (Endpoint("10.0.0.1", 0, node_name="node1", zone="z2"),))
    other = ParsedSlice("a", "s-3", "web", port, (Endpoint("10.0.0.1", 0, node_name="node2", zone="z3"),))
    for order in ([other, local, remote], [remote, other, local], [local, remote, other]):
        (eps,) = merge_slices(order, "node1").values()
        assert [(e.zone, e.is_local, e.port) for e in eps] == [("z2", True, 80)]
    (eps,) = merge_slices([other, remote], "node1").values()
    assert [(e.zone, e.is_local) for e in eps] == [("z1", False)]  # the first slice by name
