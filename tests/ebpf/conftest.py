"""The packet lab's fixtures, shared by the data-path modules (tests/ebpf/test_datapath*.py).

Each module that uses them gets its own loaded data path and packet lab (module scope), and
marks itself `pytest.mark.usefixtures("clean_maps")`: every test starts on empty maps and ends
with its counters balanced. A module that needs another data path defines its own `dp`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.ebpf.loader import Datapath
from lab.dplab import SIZES, Lab, Net, assert_balanced, packet_lab, reset_maps
from lab.packets import loaded_datapath


@pytest.fixture(scope="module")
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
