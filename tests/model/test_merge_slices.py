"""`merge_slices` against kube-proxy's merge, transcribed from upstream's
pkg/proxy/endpointslicecache.go (`endpointInfoByServicePort`, `addEndpoints`,
`endpointsMapFromEndpointInfo`) rather than from our own earlier code, so that a rule the old
and the new merge share wrongly cannot pass unseen.

Upstream walks a Go map of the Service's slices, so its order, and with it which of two copies of
a non-local endpoint wins, is random from sync to sync. Ours must equal upstream's result for SOME
order of the slices; separately, ours always takes the slices in name order (a deterministic
tie-break: the same input gives the same programs on every sync)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model import IPFamily, Protocol, ServicePortName
from agent.model.parse import ParsedSlice, SlicePort
from agent.model.tracker import merge_slices
from agent.model.types import Endpoint

Merged = dict[ServicePortName, tuple[Endpoint, ...]]


def join_host_port(host: str, port: int) -> str:
    """Go's net.JoinHostPort, which BaseEndpointInfo.String() is: brackets when the host has a colon."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def upstream_merge(slices_in_map_order: Sequence[ParsedSlice], node_name: str) -> Merged:
    """kube-proxy's EndpointsMap for one Service, its slices walked in the order given (Go's map
    iteration order, random in kube-proxy).

    What the parser already did is not repeated: ports without a number or name are dropped, and a
    slice holds only its family's addresses (upstream's `ipFamily` filter skips the others).
    """
    endpoint_info_by_sp: dict[ServicePortName, dict[str, Endpoint]] = {}
    for sl in slices_in_map_order:
        # newEndpointSliceInfo sorts a slice's endpoints by their addresses joined; we keep only the
        # first address, so copies of one address in one slice tie, and Go's unstable sort may put
        # them in any order. A stable sort keeps the slice's own order: one of upstream's results.
        endpoints = sorted(sl.endpoints, key=lambda ep: ep.ip)
        for port in sorted(sl.ports, key=lambda p: p.port):  # byPort
            spn = ServicePortName(sl.namespace, sl.service, port.name, port.protocol)
            endpoint_set = endpoint_info_by_sp.setdefault(spn, {})
            for ep in endpoints:
                is_local = len(node_name) > 0 and ep.node_name == node_name  # cache.isLocal
                # newBaseEndpointInfo: every field from this copy, the port from the slice's port
                info = Endpoint(
                    ip=ep.ip,
                    port=port.port,
                    ready=ep.ready,
                    serving=ep.serving,
                    terminating=ep.terminating,
                    node_name=ep.node_name,
                    zone=ep.zone,
                    zone_hints=ep.zone_hints,
                    node_hints=ep.node_hints,
                    is_local=is_local,
                )
                key = join_host_port(ep.ip, port.port)
                if key not in endpoint_set or is_local:
                    endpoint_set[key] = info
    # endpointsMapFromEndpointInfo: a port without endpoints is left out; byEndpoint sorts by String()
    return {
        spn: tuple(endpoint_set[k] for k in sorted(endpoint_set))
        for spn, endpoint_set in endpoint_info_by_sp.items()
        if endpoint_set
    }


def without_empty_ports(got: Merged) -> Merged:
    """Ours keeps a port whose slices hold no endpoint as `spn: ()` where upstream leaves it out.
    Harmless: the tracker reads `merged.get(spn, ())` (ProxyModel._endpoints_of), the same () both
    ways."""
    return {spn: eps for spn, eps in got.items() if eps}


# Few distinct values, so that duplicates, shared ports and prefixes are common: "10.0.0.1" /
# "10.0.0.10" sort apart once ":port" is added, and "fd00::1:a" sorts before "fd00::1" only as
# JoinHostPort brackets them ("]" after ":"), after it without brackets.
IPS = {
    IPFamily.IPv4: ["10.0.0.1", "10.0.0.10", "10.0.0.2", "9.0.0.1"],
    IPFamily.IPv6: ["fd00::1", "fd00::10", "fd00::1:a", "fd00::a"],
}
NODES = ["", "node1", "node2"]
SLICE_NAMES = ["s-1", "s-10", "s-2", "s-9"]
slice_ports = st.builds(
    SlicePort,
    name=st.sampled_from(["", "http"]),
    port=st.sampled_from([80, 8080, 9]),
    protocol=st.sampled_from([Protocol.TCP, Protocol.UDP]),
)
hints = st.frozensets(st.sampled_from(["z1", "z2"]), max_size=2)
node_hints = st.frozensets(st.sampled_from(["node1", "node2"]), max_size=2)


@st.composite
def one_services_slices(draw: st.DrawFn) -> list[ParsedSlice]:
    """What the model hands merge_slices: the slices of one Service, of the model's one family,
    each name once, as parse_endpoint_slice makes them. `read_for` is the node the slices were
    read for: the parser marks `is_local` for it, and the node may have been renamed since
    (ProxyModel.set_node), so merge_slices must decide `is_local` itself."""
    family = draw(st.sampled_from(IPFamily))
    namespace = draw(st.sampled_from(["a", "b"]))
    service = draw(st.sampled_from(["web", "db"]))
    read_for = draw(st.sampled_from(NODES))
    names = draw(st.lists(st.sampled_from(SLICE_NAMES), unique=True, max_size=4))
    out = []
    for name in names:
        # port names are unique in a slice (the parser refuses a duplicate)
        ports = tuple(draw(st.lists(slice_ports, max_size=3, unique_by=lambda p: p.name)))
        # a slice of one port gets that port in its endpoints, others 0 (parse_endpoint_slice)
        number = ports[0].port if len(ports) == 1 else 0
        endpoints = []
        for _ in range(draw(st.integers(0, 5))):
            ready = draw(st.booleans())
            node = draw(st.sampled_from(NODES))
            endpoints.append(
                Endpoint(
                    ip=draw(st.sampled_from(IPS[family])),
                    port=number,
                    ready=ready,
                    serving=draw(st.booleans()),
                    terminating=draw(st.booleans()),
                    node_name=node,
                    zone=draw(st.sampled_from(["", "z1", "z2"])),
                    zone_hints=draw(hints),
                    node_hints=draw(node_hints),
                    is_local=bool(read_for) and node == read_for,
                )
            )
        out.append(ParsedSlice(namespace, name, service, ports, tuple(endpoints), family))
    return out


@settings(max_examples=400, deadline=None)
@given(one_services_slices(), st.sampled_from(NODES))
def test_merge_slices_is_one_of_kube_proxys_possible_merges(
    given_slices: list[ParsedSlice], node_name: str
) -> None:
    got = merge_slices(iter(given_slices), node_name)
    assert all(type(ep) is Endpoint for eps in got.values() for ep in eps)
    possible = [upstream_merge(order, node_name) for order in itertools.permutations(given_slices)]
    assert without_empty_ports(got) in possible, (got, possible)


@settings(max_examples=400, deadline=None)
@given(one_services_slices(), st.sampled_from(NODES))
def test_merge_slices_breaks_kube_proxys_random_tie_by_slice_name(
    given_slices: list[ParsedSlice], node_name: str
) -> None:
    got = merge_slices(iter(given_slices), node_name)
    by_name = sorted(given_slices, key=lambda sl: sl.name)  # one Service: its slices differ by name
    assert without_empty_ports(got) == upstream_merge(by_name, node_name)


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
    # Two remote copies: kube-proxy keeps whichever its map walk meets first, at random; we keep
    # the first slice by name, whatever order the slices come in.
    for order in ([other, remote], [remote, other]):
        (eps,) = merge_slices(order, "node1").values()
        assert [(e.zone, e.is_local) for e in eps] == [("z1", False)]


def test_an_earlier_named_slices_not_ready_copy_beats_a_later_named_ones_ready_copy() -> None:
    """The name order is a tie-break, not a preference for the better copy: a terminating copy in
    the slice named first wins over a ready one in a later slice (kube-proxy may pick either on any
    sync). The endpoint then serves only as a terminating fallback until the older slice drops it."""
    port = (SlicePort("", 80, Protocol.TCP),)
    going = Endpoint("10.0.0.1", 80, ready=False, serving=True, terminating=True, node_name="node2")
    ready = Endpoint("10.0.0.1", 80, node_name="node2")
    earlier = ParsedSlice("a", "web-abc", "web", port, (going,))
    later = ParsedSlice("a", "web-xyz", "web", port, (ready,))
    for order in ([earlier, later], [later, earlier]):
        assert merge_slices(order, "node1") == {ServicePortName("a", "web", "", Protocol.TCP): (going,)}
