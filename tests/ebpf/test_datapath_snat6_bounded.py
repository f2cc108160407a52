"""IPv6's SNAT-walk packet tests on the bounded-loop build (tests/ebpf/bounded.py): a translated
NodePort flow and its reply, two clients on one source port, an unanswered holder taken over and
a full range refused. The tests are test_datapath_ipv6_snat's, run here against this module's
`dp` (and test_datapath_ipv6's IPv6 packet lab on it)."""

from __future__ import annotations

import pytest

from tests.ebpf.bounded import dp, test_the_data_path_here_walks_in_a_bounded_loop
from tests.ebpf.test_datapath_ipv6 import lab
from tests.ebpf.test_datapath_ipv6_snat import (
    test_a_full_range_takes_over_an_unanswered_flow_and_refuses_once_every_flow_is_established,
    test_a_node_port_from_outside_to_a_remote_backend_is_masqueraded_and_its_reply_translated_back,
    test_two_clients_with_one_source_port_to_one_backend_get_two_snat_ports,
)

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

__all__ = [
    "dp",
    "lab",
    "test_a_full_range_takes_over_an_unanswered_flow_and_refuses_once_every_flow_is_established",
    "test_a_node_port_from_outside_to_a_remote_backend_is_masqueraded_and_its_reply_translated_back",
    "test_the_data_path_here_walks_in_a_bounded_loop",
    "test_two_clients_with_one_source_port_to_one_backend_get_two_snat_ports",
]
