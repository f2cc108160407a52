"""Shared pytest glue: the `kernel` gate, network-namespace lab fixtures and the session leak check.

* Tests marked `kernel` (and fixtures using `kernel_required`) need root, network namespaces and BPF.
  Without them they are skipped, or fail when the environment variable CI is set (non-empty).
* `lab1`: module-scoped 1-node lab, 2 pods, podservers on every pod.
  `lab2`: module-scoped 2-node lab, 2 pods per node, podservers on every pod.
  Tests sharing a module-scoped lab should undo what they change (routes, extra pods, servers).
* `make_lab(nodes=1, pods_per_node=2, servers=True, **Lab kwargs)`: function-scoped factory; every lab
  it makes is torn down after the test (a teardown error fails the test).
* At session end every namespace, cgroup, pin, tmp dir and process of every lab created in this
  process must be gone; otherwise the leftovers are printed and the session fails.
  tests/test_lab_leaks.py is moved to the end of the run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from lab import CREATED_PREFIXES, STARTED, Lab, LabFactory, find_leaks, kernel_problem, live_labs


def require_kernel() -> None:
    """Skip (fail when CI is set) unless root, network namespaces and BPF are available."""
    reason = kernel_problem()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"kernel test cannot run although CI is set: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kernel") is not None:
        require_kernel()


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    # The leak check runs after everything else.
    items.sort(key=lambda it: it.path.name == "test_lab_leaks.py")


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Generator[None, None, None]:
    result = yield  # fixtures (session scope included) are torn down by now
    problems = [f"lab {lab.prefix} still up at session end" for lab in live_labs()]
    for lab in live_labs():
        try:
            lab.down()
        except Exception as exc:
            problems.append(str(exc))
    if CREATED_PREFIXES:
        problems += find_leaks(CREATED_PREFIXES, STARTED)
    if problems:
        text = "lab leak check failed:\n  " + "\n  ".join(problems)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(text, red=True, bold=True)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


@pytest.fixture(scope="session")
def kernel_required() -> None:
    """Skips (or fails under CI) when the machine cannot run kernel tests."""
    require_kernel()


def _lab(nodes: int, pods_per_node: int, servers: bool, **kwargs: Any) -> Lab:
    lab = Lab(nodes, pods_per_node, **kwargs).up()
    try:
        if servers:
            lab.start_podservers()
    except BaseException:
        lab.down()
        raise
    return lab


@pytest.fixture(scope="module")
def lab1(kernel_required: None) -> Iterator[Lab]:
    """1 node, 2 pods, podservers on every pod."""
    lab = _lab(1, 2, True)
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="module")
def lab2(kernel_required: None) -> Iterator[Lab]:
    """2 nodes, 2 pods each, podservers on every pod."""
    lab = _lab(2, 2, True)
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture
def make_lab(kernel_required: None) -> Iterator[LabFactory]:
    """Factory for labs torn down at the end of the test."""
    labs: list[Lab] = []

    def factory(nodes: int = 1, pods_per_node: int = 2, *, servers: bool = True, **kwargs: Any) -> Lab:
        lab = _lab(nodes, pods_per_node, servers, **kwargs)
        labs.append(lab)
        return lab

    yield factory
    errors = []
    for lab in reversed(labs):
        try:
            lab.down()
        except Exception as exc:
            errors.append(str(exc))
    if errors:
        pytest.fail("; ".join(errors), pytrace=False)
