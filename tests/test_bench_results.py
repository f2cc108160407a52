"""The README's benchmark figures come from a run's file, and only from there.

`make bench` writes bench/results/<date>-<commit>.json; `python -m bench.report --readme` renders
one of those files into the README between the `bench-results` markers. Checked here, without a
kernel: the block is exactly what its cited file renders, the cited file is the newest run, every
figure the benchmark prose around the block quotes is in that file, and a run's tables rendered
from its file are the tables rendered from the live objects (nothing is lost on the way to JSON).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import api, capacity, health, record, report
from bench.bpfstats import Cost
from bench.progcost import PacketCost
from bench.run import PacketCosts, Results, Settings, State, StatsWindow, SyncFacts, Target
from bench.run import tables as live_tables
from bench.traffic import Load

README = record.REPO / "README.md"


def benchmark_section() -> str:
    text = README.read_text()
    start = text.index("\n## Benchmarks\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_readme_block_is_what_its_cited_file_renders() -> None:
    text = README.read_text()
    m = report.BLOCK.search(text)
    assert m is not None, "README.md has no bench-results block"
    path = report.cited(text)
    assert path.exists(), f"the README cites {path}, which is not in the repository"
    assert m.group(0) == report.readme_block(path), "run `python -m bench.report --readme`"
    beside = path.with_suffix(".md")
    assert beside.read_text() == record.render(record.load(path), path), f"{beside} is stale"


def test_the_readme_cites_the_newest_run() -> None:
    assert report.cited(README.read_text()) == record.newest(), "run `python -m bench.report --readme`"


FIGURE = re.compile(r"(?<![\w.-])(\d[\d,]*(?:\.\d+)?)(%|k(?![\w-]))?(?![\w-])")


def figures(text: str) -> set[str]:
    """Figures in prose: numbers with commas dropped, "50k" as 50000, a percentage kept with its
    sign (it must be a percentage in the file); code spans and link targets are names, not figures."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    out = set()
    for number, unit in FIGURE.findall(text):
        plain = number.replace(",", "")
        if unit == "k":
            plain = f"{float(plain) * 1000:g}"
        out.add(plain + "%" if unit == "%" else plain)
    return out


def raw_figures(value: object) -> set[str]:
    """The numbers a results file's JSON holds as measures or parameters: every number but the
    elements of a list of numbers. Such a list holds a measure's samples (hundreds of them), which
    the file's rendering reduces to its percentiles; taken one by one, and rounded, they would
    hold nearly any figure prose could quote, so a figure from elsewhere would pass by accident.
    The check stays permissive all the same (measured on 2026-11-28: about a quarter of made-up
    figures of two decimals under 10 are held by the newest run's file, against two fifths with
    the samples), so it catches a figure with no source, not every wrong one. A host's settings
    kept as a list of numbers (its load averages) go with the samples."""
    if isinstance(value, dict):
        return set().union(set(), *(raw_figures(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(set(), *(raw_figures(v) for v in value if isinstance(v, (dict, list, str))))
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, (int, float)):
        return {repr(value)}
    return {n.replace(",", "") for n, _ in FIGURE.findall(str(value))}


def file_figures(path: Path) -> set[str]:
    """The figures a results file holds: its rendering's and its raw measures (raw_figures), each
    also rounded to fewer digits (prose may say 0.5 for 0.4993)."""
    found = figures(record.render(record.load(path), path)) | raw_figures(json.loads(path.read_text()))
    for value in list(found):
        number = value.rstrip("%")
        if "." in number:
            found |= {f"{float(number):.{d}f}" + ("%" if value.endswith("%") else "") for d in range(3)}
    return found


def test_every_figure_in_the_benchmark_prose_is_in_the_cited_file() -> None:
    """Outside the generated block the prose may only quote what the run it cites measured or was
    given (its parameters, its host): a figure from an earlier host or run has no file behind it."""
    section = benchmark_section()
    prose = report.BLOCK.sub("", section + "\n")
    path = report.cited(README.read_text())
    missing = sorted(figures(prose) - file_figures(path), key=lambda f: float(f.rstrip("%")))
    assert not missing, f"figures in the README's benchmark prose that {path.name} does not hold: {missing}"


def test_a_measures_samples_are_not_figures_of_its_file() -> None:
    """A sample of a list is quoted through the rendering's percentiles, never on its own."""
    held = raw_figures(
        {"services": 10000, "rss_mib": 217.4, "change_ms": [2.599, 11.13], "label": "load 4.04"}
    )
    assert held == {"10000", "217.4", "4.04"}


def test_the_prose_check_catches_a_figure_from_elsewhere() -> None:
    path = report.cited(README.read_text())
    assert "987654.3" not in file_figures(path)
    assert figures("reached 987,654.3 conn/s with `wrk -t2`, 50k with wrk -t4, 64% of one core") == {
        "987654.3",
        "50000",
        "64%",
    }


# ---- a run's file renders what the run printed ---------------------------------------------


def load(rate: float, errors: int = 0) -> Load:
    return Load(rate, int(rate), errors, 1.0, 40.0, 90.0, float("nan"), "")


def target(rates: list[float], samples: list[int]) -> Target:
    unpinned = [2 * s for s in samples]
    return Target(
        loads=[load(r) for r in rates], samples_ns=samples, probe_errors={"timeout": 1}, unpinned_ns=unpinned
    )


def small_run() -> tuple[Results, Settings, list[api.ApiScale], capacity.Result]:
    samples = [20_000 + 37 * i for i in range(200)]
    results = Results(
        states=[
            State("ebpf", "none (before)", None, pod=target([1000.0, 1100.0], samples)),
            State("ebpf", "5", 5, pod=target([900.0, 950.0], samples), vip=target([890.0, 940.0], samples)),
            State("ebpf", "none (after)", None, pod=target([1010.0, 990.0], samples)),
        ],
        syncs=[
            SyncFacts("ebpf", 5, 7, 0.25, 0.125, 3.0, "map entries: ekp_fe_v2 10", 0.002, None),
            SyncFacts(
                "iptables-legacy, synthetic state", 5, 10, float("nan"), float("nan"), 40.0, "x", 0.03, True
            ),
        ],
        stats=[
            StatsWindow(
                "ebpf", 5, "ClusterIP", 900, [Cost("ekp_from_pod", 9000, 650.5), Cost("n", 0, float("nan"))]
            )
        ],
        packets=[
            PacketCosts(1, [PacketCost("ekp_from_pod", "pod -> pod IP", False, 90.5)]),
            PacketCosts(
                5,
                [
                    PacketCost("ekp_from_pod", "pod -> pod IP", False, 151.0),
                    PacketCost("ekp_from_pod", "pod -> ClusterIP", True, 400.25),
                ],
            ),
        ],
        notes=["one note"],
        stats_sysctl_before="0",
        iptables_backend="nft",
    )
    settings = Settings(5, 1, 2, 2, 64, 200, ["ebpf"], None, True)
    scales = [
        api.ApiScale("ebpf", 5, 10, 0.5, 1.5, 1.0, "compiled in 1.0s", 1.2, 300.0, [1.0, 2.0], [1.5, 2.5]),
        api.ApiScale("iptables", 5, 10, iptables_backend="legacy", change_log_ms=[30.0]),
    ]
    return results, settings, scales, capacity.Result(2, 131072, 262144, 131104, 262100, 31457280, 40.0)


def test_a_runs_file_renders_the_tables_of_the_run(tmp_path: Path) -> None:
    results, settings, scales, cap = small_run()
    NAN = float("nan")
    hr = health.Result(
        200,
        series=[
            health.Series("ebpf", "/healthz", health.NONE, 200, 0, 0.5, 6.03, 6.79),
            health.Series("ebpf", "/healthz", health.SLOW_LOAD, 200, 0, 0.52, 7.0, 9.1, 127, 2),
            # every probe failed: no percentiles (NaN, null in the file)
            health.Series("iptables", "healthCheckNodePort", health.SLOW_LOAD, 3, 3, NAN, NAN, NAN, 0, 1),
        ],
        load_average=[0.4, 0.6],
    )
    run = record.make(
        argv=["--services", "5"],
        parameters={**settings.__dict__, "modes": list(settings.modes), "api_services": 5},
        parts=["traffic", "api", "capacity", "health"],
        started=__import__("datetime").datetime(2026, 11, 26, 12, 0),
        seconds=12.5,
        host={
            "cpu_model": "CPU",
            "cpus": 2,
            "kernel": "k",
            "os": "os",
            "load_average_at_start": 1.0,
            "tools": {
                "wrk": "wrk 4.1.0",
                "iptables": "iptables v1.8.9 (nf_tables)",
                "nginx": "n",
                "bcc": "0.26",
            },
        },
        results=results,
        scales=scales,
        capacity_result=cap,
        health_result=hr,
    )
    path = record.save(run, tmp_path)
    text = path.read_text()
    assert (
        "NaN" not in text
        and json.loads(text)["traffic"]["states"][0]["pod"]["loads"][0]["others_pct"] is None
    )
    from_file = record.tables(record.load(path))
    live = [
        *live_tables(results, settings, "nft (the agent's auto choice)"),
        api.table(scales),
        capacity.table(cap),
        health.table(hr),
    ]
    assert [t.markdown() for t in from_file] == [t.markdown() for t in live]
    rendered = record.save_markdown(path).read_text()
    assert "traffic: nft (the agent's auto choice)" in rendered
    assert "api: legacy (--api-iptables-backend)" in rendered
    assert "- NOTE: one note" in rendered
    # the programs' ns per packet and the issue 16 targets, missed by how much
    assert "| ekp_from_pod | pod -> pod IP | no | 90.5 | 151.0 |" in rendered
    assert "| ebpf | 5 | pod -> pod IP | ns/packet | 151.0 | missed by 1 ns |" in rendered
    assert "| ebpf | 1 | pod -> pod IP | ns/packet | 90.5 | met |" in rendered
    assert "| ebpf | 5 | pod -> ClusterIP | conn/s | 0.89 | missed by 8.7 pts |" in rendered
    assert "| ebpf | /healthz | slow + idle | 200 | 0.52 | 7.00 | 9.10 | 0 | 127 of 128 |" in rendered
    assert "| iptables | healthCheckNodePort | slow + idle | 3 | - | - | - | 3 | 0 of 128 |" in rendered


# ---- the control plane at scale (issue 18), and the histories beside the results ----------

SCALE_TARGETS = {"2", "10", "300", "1", "18"}  # the targets (2 s, 10 ms, 300 MiB, 1 GiB, 10 s)

# The round-by-round histories moved out of the README: prose quoting many runs, each named.
ROUNDS = record.REPO / "bench" / "results" / "scale" / "ROUNDS.md"
BENCH_HISTORY = record.REPO / "bench" / "results" / "HISTORY.md"
SUITE_RUNS = record.REPO / "bench" / "results" / "suite" / "RUNS.md"
HISTORIES = (ROUNDS, BENCH_HISTORY, SUITE_RUNS)
CITED = re.compile(r"`(bench/results/[\w./-]+)`")
# Any mention of a results path, in a code span, a link or plain prose; a trailing "." or "/" ends
# a sentence or names a directory, a trailing "-" a family of files (a `-run1-` to `-run3-` span).
MENTIONED = re.compile(r"bench/results/[\w./-]*")


def scale_section() -> str:
    text = README.read_text()
    start = text.index("\n## The control plane at scale\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def cited_results(text: str) -> list[str]:
    """The results files `text` names in code spans. A history file is prose, not a measurement,
    and a directory is no file: naming one cites nothing."""
    return sorted(
        {n for n in CITED.findall(text) if record.REPO / n not in HISTORIES and not n.endswith("/")}
    )


def held_by(names: list[str]) -> set[str]:
    """The figures the named results files hold: a run's file (.json) as file_figures reads it, its
    rendering beside it checked current; any other file's numbers as written."""
    held: set[str] = set()
    for name in names:
        path = record.REPO / name
        assert path.is_file(), f"{name} is cited but is not a file in the repository"
        if path.suffix == ".json":
            held |= file_figures(path)
            assert path.with_suffix(".md").read_text() == record.render(record.load(path), path)
        else:
            held |= {n.replace(",", "") for n, _ in FIGURE.findall(path.read_text())}
    return held


def unsourced(text: str, allowed: set[str]) -> list[str]:
    names = cited_results(text)
    assert names, "the text names no results file"
    missing = figures(text) - held_by(names) - allowed
    return sorted(missing, key=lambda f: float(f.rstrip("%")))


def test_every_figure_in_the_scale_section_is_in_a_file_it_cites() -> None:
    """The section quotes runs kept in bench/results/ (bench/results/scale/ and bench.records'
    output there, the suite's runs): every figure in it is in one of the files it names, or is one
    of the issue's targets."""
    missing = unsourced(scale_section(), SCALE_TARGETS)
    assert not missing, f"figures in the README's scale section that its files do not hold: {missing}"


def test_every_figure_in_the_rounds_is_in_a_file_they_cite() -> None:
    """The rounds moved out of the scale section are held to what the section was: every figure in
    a file it names (the whole file's names together, as the section's were), or a target."""
    missing = unsourced(ROUNDS.read_text(), SCALE_TARGETS)
    assert not missing, f"figures in {ROUNDS.name} that its files do not hold: {missing}"


def test_every_figure_in_the_benchmark_history_is_in_a_file_it_cites() -> None:
    """The benchmark prose moved out of the README, held to the runs it names (it was held to the
    run the README cited then; a newer run must not make it wrong)."""
    missing = unsourced(BENCH_HISTORY.read_text(), set())
    assert not missing, f"figures in {BENCH_HISTORY.name} that its files do not hold: {missing}"


def test_a_history_file_is_no_source() -> None:
    """Positive control: a figure whose only source is a history file that names it is unsourced."""
    rounds = ROUNDS.relative_to(record.REPO)
    text = f"restart -> synced 987,654.3 s (`{rounds}`, `bench/results/scale/records.txt`)"
    assert cited_results(text) == ["bench/results/scale/records.txt"]
    assert unsourced(text, set()) == ["987654.3"]


def mentioned_results(text: str) -> set[str]:
    return {n.rstrip("./") for n in MENTIONED.findall(text)}


def missing_results(names: set[str]) -> list[str]:
    """The names no file or directory answers (a name ending in "-" answers to the files it begins)."""
    missing = []
    for name in sorted(names):
        path = record.REPO / name
        if name.endswith("-"):
            found = any(p.name.startswith(path.name) for p in path.parent.iterdir())
        else:
            found = path.exists()
        if not found:
            missing.append(name)
    return missing


DOCS_CITING_RESULTS = [README, record.REPO / "bpf" / "README.md", *HISTORIES]


def test_every_results_file_the_docs_name_exists() -> None:
    """Every bench/results path the README, bpf/README.md and the histories mention is there,
    in a code span or not: a renamed or dropped results file leaves its figures unsourced."""
    for doc in DOCS_CITING_RESULTS:
        names = mentioned_results(doc.read_text())
        assert names, f"{doc.name} mentions no results file: the pattern no longer reads it"
        missing = missing_results(names)
        assert not missing, f"{doc.relative_to(record.REPO)} names results that do not exist: {missing}"


def test_a_results_file_that_is_not_there_is_found() -> None:
    """Positive control: a sentence's full stop is not part of the name; a missing file is."""
    names = mentioned_results(
        "See `bench/results/scale/records.txt`. And bench/results/scale/no-such-run-2026-11-28.json."
    )
    assert names == {"bench/results/scale/records.txt", "bench/results/scale/no-such-run-2026-11-28.json"}
    assert missing_results(names) == ["bench/results/scale/no-such-run-2026-11-28.json"]


def test_the_readme_flood_block_is_what_the_newest_flood_run_renders() -> None:
    text = README.read_text()
    m = report.FLOOD_BLOCK.search(text)
    assert m is not None, "README.md has no bench-flood block"
    path = report.cited(text, report.FLOOD_BLOCK)
    assert path == record.newest(part="flood"), "run `python -m bench.report --readme`"
    assert m.group(0) == report.readme_block(path, "bench-flood")
