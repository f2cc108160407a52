"""The renderer is safe on its own: no string that reaches it can break out of its argument.

The states here are built from model types directly, not through `build_state`: the model refuses
these names too, and the point is that the renderer would not need it to (defence in depth).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.iptables.rules import RenderOptions, render
from agent.iptables.safety import is_canonical_ipv4, is_ipv4_cidr, refusal
from agent.model.types import (
    Endpoint,
    NodeInfo,
    Protocol,
    ProxyState,
    ServiceEndpoints,
    ServicePort,
    ServicePortName,
)
from tests.iptables.objects import CONFIG, NODE

OPTS = RenderOptions.from_config(CONFIG)
INJECT_NAT = "x\n-I INPUT 1 -s 6.6.6.6/32 -j ACCEPT\n#"
INJECT_FILTER = "y\n-I FORWARD 1 -s 6.6.6.6/32 -j ACCEPT\n#"
BUILTIN_TARGETS = {"ACCEPT", "DROP", "REJECT", "RETURN", "MARK", "MASQUERADE", "DNAT"}


def port(name: str, ip: str, *, namespace: str = "ns", port_name: str = "http", **kw: object) -> ServicePort:
    spn = ServicePortName(namespace, name, port_name, Protocol.TCP)
    return ServicePort(name=spn, cluster_ip=ip, port=80, protocol=Protocol.TCP, **kw)  # type: ignore[arg-type]


def make_state(*ports_and_endpoints: tuple[ServicePort, tuple[Endpoint, ...]]) -> ProxyState:
    services = {sp.name: sp for sp, _ in ports_and_endpoints}
    chosen = {
        sp.name: ServiceEndpoints(cluster=eps, all_reachable=eps, has_any=bool(eps))
        for sp, eps in ports_and_endpoints
    }
    raw = {sp.name: eps for sp, eps in ports_and_endpoints}
    return ProxyState(node=NodeInfo("node1"), services=services, endpoints=chosen, raw_endpoints=raw)


GOOD = (port("ok", "10.96.0.6"), (Endpoint("10.244.2.6", 8080),))


def assert_only_our_grammar(text: str) -> None:
    """Every line is a table header, a chain declaration, an `-A` rule whose chain and target were
    declared (or are built-in targets), an `-X` of a declared chain, or COMMIT."""
    for table in text.split("COMMIT\n"):
        declared = {line[1:].split()[0] for line in table.splitlines() if line.startswith(":")}
        for line in table.splitlines():
            if line.startswith(("*", ":")) or not line:
                assert re.fullmatch(r"\*(filter|nat)|:[A-Z0-9-]+ - \[0:0\]|", line), line
                continue
            argv = shlex.split(line)
            assert argv[0] in ("-A", "-X"), line
            assert argv[1] in declared, line
            if "-j" in argv:
                target = argv[argv.index("-j") + 1]
                assert target in declared or target in BUILTIN_TARGETS, line
            # A comment is one argument, and nothing after the target looks like a new command.
            for i, arg in enumerate(argv[2:], 2):
                if arg in ("-I", "-D", "-F", "-X", "-N", "-P", "-R", "-Z"):
                    raise AssertionError(f"command {arg} inside a rule: {line!r} (argument {i})")


def test_service_name_with_a_newline_is_refused_and_injects_nothing() -> None:
    bad = (port(INJECT_NAT, "10.96.0.5"), (Endpoint("10.244.2.5", 8080),))
    r = render(make_state(bad, GOOD), NODE, OPTS)
    assert not [line for line in r.text.splitlines() if line.startswith("-I")]
    assert "6.6.6.6" not in r.text
    assert set(r.refused) == {bad[0].name}
    assert "service name 'x\\n-I INPUT 1" in r.refused[bad[0].name]
    assert '"ns/ok:http cluster IP"' in r.text  # the valid service is still rendered
    assert_only_our_grammar(r.text)


def test_service_without_endpoints_cannot_inject_into_the_filter_table() -> None:
    bad = (port(INJECT_FILTER, "10.96.0.5"), ())
    r = render(make_state(bad, GOOD), NODE, OPTS)
    assert "6.6.6.6" not in r.text and "-I FORWARD" not in r.text
    assert set(r.refused) == {bad[0].name}
    assert_only_our_grammar(r.text)


def test_name_with_a_space_is_refused_and_the_rest_still_parses() -> None:
    bad = (port("a b", "10.96.0.5"), (Endpoint("10.244.2.5", 8080),))
    r = render(make_state(bad, GOOD), NODE, OPTS)
    assert set(r.refused) == {bad[0].name}
    assert "a b" not in r.text
    assert_only_our_grammar(r.text)


def test_valid_names_render_exactly_as_before() -> None:
    assert refusal(GOOD[0], GOOD[1]) is None
    r = render(make_state(GOOD), NODE, OPTS)
    assert r.refused == {}
    assert (
        '-A KUBE-SERVICES -m comment --comment "ns/ok:http cluster IP" -m tcp -p tcp -d 10.96.0.6 ' in r.text
    )


def test_every_rendered_value_is_checked() -> None:
    ep = (Endpoint("10.244.2.5", 8080),)
    cases = {
        "namespace": (port("ok", "10.96.0.5", namespace="Ns"), ep),
        "port name": (port("ok", "10.96.0.5", port_name="h p"), ep),
        "cluster IP": (port("ok", "10.96.0.05"), ep),
        "external IP": (port("ok", "10.96.0.5", external_ips=("1.2.3.4 -j ACCEPT",)), ep),
        "load-balancer IP": (port("ok", "10.96.0.5", load_balancer_ips=("1.2.3.4\n",)), ep),
        "loadBalancerSourceRange": (
            port("ok", "10.96.0.5", load_balancer_source_ranges=("1.2.3.0/24 x",)),
            ep,
        ),
        "node port": (port("ok", "10.96.0.5", node_port=70000), ep),
        "endpoint address": (port("ok", "10.96.0.5"), (Endpoint("10.244.2.5 ", 8080),)),
        "endpoint port": (port("ok", "10.96.0.5"), (Endpoint("10.244.2.5", 0),)),
    }
    for field, (sp, eps) in cases.items():
        reason = refusal(sp, eps)
        assert reason is not None and field in reason, (field, reason)


def test_address_and_cidr_predicates() -> None:
    assert is_canonical_ipv4("10.0.0.1")
    for bad in ("010.0.0.1", "10.0.0.1/32", " 10.0.0.1", "::1", "10.0.0", 167772161):
        assert not is_canonical_ipv4(bad), bad
    assert is_ipv4_cidr(" 10.1.2.3/16 ")  # the API lets spaces through here; upstream trims them
    for bad in ("10.0.0.1", "10.0.0.0/33", "fd00::/64", "10.0.0.0/8 -j ACCEPT"):
        assert not is_ipv4_cidr(bad), bad


_hostile = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)


@settings(max_examples=300, deadline=None)
@given(
    _hostile, _hostile, _hostile, st.sampled_from(["10.96.0.5", "10.96.0.5 x", "1.2.3.4\n-j"]), st.booleans()
)
def test_no_string_breaks_out_of_its_argument(
    namespace: str, name: str, port_name: str, ip: str, with_endpoints: bool
) -> None:
    sp = port(name, ip, namespace=namespace, port_name=port_name, external_ips=(ip,), node_port=30001)
    eps = (Endpoint("10.244.2.5", 8080),) if with_endpoints else ()
    r = render(make_state((sp, eps), GOOD), NODE, replace(OPTS, masquerade_all=True))
    assert_only_our_grammar(r.text)
    assert (sp.name in r.refused) == (refusal(sp, eps) is not None)
