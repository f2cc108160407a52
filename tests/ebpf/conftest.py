"""The packet lab's fixtures, shared by the data-path modules (tests/ebpf/test_datapath*.py).

The loaded data path is one per test process (session scope: loading it is the verifier's work
on every program, seconds each time, and it holds nothing a test leaves behind that `clean_maps`
does not reset); each module that uses it gets its own packet lab (module scope), and marks itself
`pytest.mark.usefixtures("clean_maps")`: every test starts on empty maps and the live config, and
ends with its counters balanced. A module that needs another data path defines its own `dp`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.ebpf.loader import Datapath
from lab.dplab import SIZES, Lab, Net, assert_balanced, packet_lab, reset_maps
from lab.packets import loaded_datapath


@pytest.fixture(scope="session")
def dp() -> Iterator[Datapath]:
    with loaded_datapath(SIZES) as datapath:
        yield datapath


@pytest.fixture(scope="module")
def lab(dp: Datapath) -> Iterator[Lab]:
    with packet_lab() as built:
        yield built


@pytest.fixture
def clean_maps(dp: Datapath, lab: Lab) -> Iterator[None]:
    reset_maps(dp)
    yield
    assert_balanced(dp)


@pytest.fixture
def net(dp: Datapath, lab: Lab) -> Net:
    return Net(dp, lab)
