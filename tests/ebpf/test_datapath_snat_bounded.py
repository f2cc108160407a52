"""IPv4's SNAT-walk packet tests on the bounded-loop build (tests/ebpf/bounded.py): TCP and UDP,
a second client on a taken source port, an unanswered holder evicted, a full range refused. The
tests are those of their own modules, run here against this module's `dp`."""

from __future__ import annotations

import pytest

from tests.ebpf.bounded import dp, test_the_data_path_here_walks_in_a_bounded_loop
from tests.ebpf.test_datapath import (
    test_direct_udp_datagram_from_the_port_of_a_live_service_flow_gets_another_port,
    test_snat_port_exhaustion_drops,
)
from tests.ebpf.test_datapath_floods import (
    test_a_full_range_evicts_an_unanswered_flow_for_a_real_client,
    test_a_range_full_of_established_flows_refuses_the_next,
    test_two_cpus_claiming_one_free_snat_port_at_once_never_both_count_it,
)
from tests.ebpf.test_datapath_flows import test_one_udp_client_port_through_two_frontends

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("clean_maps")]

__all__ = [
    "dp",
    "test_a_full_range_evicts_an_unanswered_flow_for_a_real_client",
    "test_a_range_full_of_established_flows_refuses_the_next",
    "test_direct_udp_datagram_from_the_port_of_a_live_service_flow_gets_another_port",
    "test_one_udp_client_port_through_two_frontends",
    "test_snat_port_exhaustion_drops",
    "test_the_data_path_here_walks_in_a_bounded_loop",
    "test_two_cpus_claiming_one_free_snat_port_at_once_never_both_count_it",
]
