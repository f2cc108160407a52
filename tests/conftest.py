"""Shared pytest glue: the `kernel` gate, network-namespace lab fixtures and the session leak check.

* Tests marked `kernel` (and fixtures using `kernel_required`) need root, network namespaces and BPF.
  Without them they fail. Nothing in `make test` may skip: a run with any skipped item fails at the
  end, naming them, so a machine where the lab cannot run is red, never green with the lab unrun.
  The one opt-out is explicit: EKP_ALLOW_SKIP=1 (`make unit`, `make test-latest`), and CI ignores
  it (a CI run skips nothing whatever the environment says).
* `lab1`: module-scoped 1-node lab, 2 pods, podservers on every pod.
  `lab2`: module-scoped 2-node lab, 2 pods per node, podservers on every pod.
  Tests sharing a module-scoped lab should undo what they change (routes, extra pods, servers).
* `make_lab(nodes=1, pods_per_node=2, servers=True, **Lab kwargs)`: function-scoped factory; every lab
  it makes is torn down after the test (a teardown error fails the test).
* At session end every namespace, cgroup, pin, tmp dir and process of every lab created in this
  process must be gone; otherwise the leftovers are printed and the session fails.
  tests/test_lab_leaks.py is moved to the end of the run.
* The machine's own sysctls that the agent's node set-up can write (lab/hostsysctls.py:
  ip_forward, IPv6 forwarding, route_localnet, nf_conntrack_max, hash size, the conntrack timeouts,
  tcp_be_liberal) are read when the run starts and again at its end: any that changed fails the
  run, naming it (a test let an agent's set-up run in the machine's namespace instead of a lab
  node's); tests/test_lab_leaks.py checks the same as a test.
* In parallel (`make test` runs `pytest -n 3`, pytest-xdist) tests go to workers in run groups that
  share a lab (tests/parallel.py). Each worker runs the session-end check on its own labs and
  hands what it found to the controller, which fails the run on it, and on any skipped item.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from lab import CREATED_PREFIXES, STARTED, Lab, LabFactory, find_leaks, hostsysctls, kernel_problem, live_labs
from tests import parallel


def skips_allowed() -> bool:
    """Whoever runs the suite said skips are fine (EKP_ALLOW_SKIP=1), and this is not CI."""
    return os.environ.get("EKP_ALLOW_SKIP") == "1" and not os.environ.get("CI")


def require_kernel() -> None:
    """Fail (skip only where skips_allowed) unless root, network namespaces and BPF are available."""
    reason = kernel_problem()
    if reason is None:
        return
    if not skips_allowed():
        pytest.fail(
            f"kernel test cannot run: {reason} (run `make test` as root on a machine with BPF and "
            "network namespaces; `make unit` runs the pure tests alone)",
            pytrace=False,
        )
    pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("kernel") is not None:
        require_kernel()


def _parallel(config: pytest.Config) -> bool:
    """This process schedules (the controller) or runs (a worker) tests on xdist workers."""
    return config.getoption("dist", "no") != "no" or hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        config.stash[_GROUPS_PREFIX] = os.path.join(tempfile.mkdtemp(prefix="ekp-run-groups-"), "groups")
    config.stash[_MACHINE] = hostsysctls.Machine()  # made here: this thread is in the run's own namespace
    if not hasattr(config, "workerinput"):
        config.stash[_SESSION_DIR] = tempfile.mkdtemp(prefix="ekp-session-")
        host = config.stash[_MACHINE].snapshot()
        config.stash[_HOST_SYSCTLS] = host
        with open(os.path.join(config.stash[_SESSION_DIR], HOST_SYSCTLS_FILE), "w") as f:
            json.dump(host, f)


_GROUPS_PREFIX = pytest.StashKey[str]()
_SESSION_DIR = pytest.StashKey[str]()
_HOST_SYSCTLS = pytest.StashKey[dict[str, str]]()
_MACHINE = pytest.StashKey[hostsysctls.Machine]()
HOST_SYSCTLS_FILE = "host-sysctls.json"  # in the session directory: the values the run started with
SESSION_DIR = "ekp_session_dir"  # workerinput key: the directory every worker of the run shares


def pytest_unconfigure(config: pytest.Config) -> None:
    prefix = config.stash.get(_GROUPS_PREFIX, None)
    if prefix is not None:
        shutil.rmtree(os.path.dirname(prefix), ignore_errors=True)
    shared = config.stash.get(_SESSION_DIR, None)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[parallel.GROUPS_FILE] = node.config.stash[_GROUPS_PREFIX]
    node.workerinput[SESSION_DIR] = node.config.stash[_SESSION_DIR]


@pytest.fixture(scope="session")
def session_dir(pytestconfig: pytest.Config) -> str:
    """A directory every process of this run shares (all its xdist workers), removed at its end:
    for what one run group makes and another may use (compiled objects, behind a lock per entry),
    so that splitting a module into run groups costs nothing twice."""
    workerinput: dict[str, Any] = getattr(pytestconfig, "workerinput", {})
    return str(workerinput.get(SESSION_DIR) or pytestconfig.stash[_SESSION_DIR])


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None  # `each`, `worksteal`: xdist's own
    return parallel.make_scheduler(config, log, config.stash[_GROUPS_PREFIX])


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if _parallel(config):
        parallel.write_groups(config, parallel.queue_order(items))
    else:
        # The leak check runs after everything else.
        items.sort(key=lambda it: it.path.name == "test_lab_leaks.py")


# What each xdist worker's session-end check found, gathered by the controller.
_WORKER_PROBLEMS: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    _WORKER_PROBLEMS.extend(getattr(node, "workeroutput", {}).get("ekp_problems", []))


# trylast: inside xdist's own wrapper, so a worker's findings are in `workeroutput` before it is sent.
@pytest.hookimpl(wrapper=True, trylast=True)
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
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports, skips included
        workeroutput["ekp_problems"] = problems
        return result
    problems += _WORKER_PROBLEMS
    problems += host_sysctl_problems(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in reporter.stats.get("skipped", []) if r.when] if reporter is not None else []
    if skipped and not skips_allowed():
        problems.append(
            f"{len(skipped)} item(s) skipped, and this run allows none (EKP_ALLOW_SKIP=1 outside CI "
            "opts out): " + "; ".join(f"{r.nodeid}: {_skip_reason(r)}" for r in skipped[:20])
        )
    if problems:
        text = "the run is not clean:\n  " + "\n  ".join(problems)
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(text, red=True, bold=True)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


def host_sysctl_problems(config: pytest.Config) -> list[str]:
    """The machine's own sysctls this run found one way and leaves another, as leak lines."""
    before = config.stash.get(_HOST_SYSCTLS, {})
    machine = config.stash.get(_MACHINE, None)
    if not before or machine is None:
        return []
    return [
        f"the machine's own {change} since the run started (a test ran an agent's node set-up "
        "outside its lab node's namespace, or another process on the machine wrote it; the test "
        "is named by the per-test check above if a test's run saw it); restore it with sysctl -w"
        for change in hostsysctls.changed(before, machine.snapshot())
    ]


# The machine's values after the last test of this process, and that test.
_LAST_SEEN: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _machine_sysctls_untouched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test in whose run (or between whose fixtures and the last test's) the machine's
    own sysctls of lab/hostsysctls.py changed, naming them: the session-end check says that they
    changed, this says where. A test on another xdist worker at the same moment sees the change too,
    and so does a test running while another process on the machine writes them: the culprit is
    one of the tests named, or that process. A value written and restored within one test is not
    seen (only each test's start and end are read), though labs made meanwhile inherit it."""
    machine = request.config.stash.get(_MACHINE, None)
    if machine is None:
        yield
        return
    before = machine.snapshot()
    yield
    after = machine.snapshot()
    lines = [f"{c} while this test ran" for c in hostsysctls.changed(before, after)]
    if "values" in _LAST_SEEN:
        lines += [
            f"{c} between the end of {_LAST_SEEN['test']} and the start of this test (a fixture's "
            "set-up or tear-down)"
            for c in hostsysctls.changed(_LAST_SEEN["values"], before)
        ]
    _LAST_SEEN.update(values=after, test=request.node.nodeid)
    if lines:
        pytest.fail(
            "the machine's own sysctls changed (an agent's node set-up ran outside its lab node's "
            "namespace, here or in a test on another worker at the same time, or another process "
            "on the machine wrote them):\n  " + "\n  ".join(lines),
            pytrace=False,
        )


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


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
