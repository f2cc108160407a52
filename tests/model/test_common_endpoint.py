"""The fast reading of common endpoints agrees with the full validation on everything it accepts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model.parse import _common_endpoint, _endpoint_checked
from agent.model.validate import ParseError

ADDRESSES = [
    "10.244.1.2",
    "10.244.1.02",
    "0.0.0.0",
    "127.0.0.1",
    "169.254.1.1",
    "224.0.0.5",
    "1.2.3.4",
    "fd00::5",
    "10.244.1.256",
    " 10.1.1.1",
    7,
    None,
]
BOOLS: list[Any] = [True, False, None, "false", 1, 0]
NODES: list[Any] = ["node1", "Node1", "node_1", "", None, 5, "a" * 300]


@st.composite
def endpoints(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 20)) == 0:
        return draw(st.sampled_from([None, [], "x", 5]))
    item: dict[str, Any] = {}
    addresses = draw(st.lists(st.sampled_from(ADDRESSES), min_size=0, max_size=2))
    if draw(st.booleans()) or addresses:
        item["addresses"] = addresses if draw(st.integers(0, 9)) else "10.1.1.1"
    if draw(st.booleans()):
        item["conditions"] = (
            {
                k: draw(st.sampled_from(BOOLS))
                for k in ("ready", "serving", "terminating")
                if draw(st.booleans())
            }
            if draw(st.integers(0, 9))
            else "ready"
        )
    if draw(st.booleans()):
        item["nodeName"] = draw(st.sampled_from(NODES))
    if draw(st.booleans()):
        item["zone"] = draw(st.sampled_from(["zone-a", "", None, 3]))
    if draw(st.integers(0, 5)) == 0:
        item[draw(st.sampled_from(["hostname", "hints", "targetRef", "other"]))] = draw(
            st.sampled_from(["h1", {"forZones": [{"name": "a"}]}, {"kind": "Pod"}, None])
        )
    return item


@settings(max_examples=600, deadline=None)
@given(endpoints())
def test_fast_and_full_agree(item: Any) -> None:
    fast = _common_endpoint(item)
    if fast is None:
        return  # the full validation decides alone
    try:
        full = _endpoint_checked(item, "IPv4", "endpoints[0]")
    except ParseError as exc:
        raise AssertionError(f"fast path accepted what the full validation refuses: {exc}") from exc
    assert fast == full


def test_the_common_shape_takes_the_fast_path() -> None:
    item = {"addresses": ["10.244.1.2"], "conditions": {"ready": True}, "nodeName": "node1", "zone": "a"}
    assert _common_endpoint(item) == _endpoint_checked(item, "IPv4", "e")
    assert _common_endpoint({**item, "addresses": ["10.244.1.02"]}) is None, "sloppy addresses: full path"
