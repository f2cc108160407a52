"""The Prometheus text format exactly as kube-proxy's Go client writes it.

prometheus_client's own `generate_latest` differs from a scrape of kube-proxy in ways a strict
dashboard or a recording rule can notice: it writes `1.0` where Go writes `1` (also in `le="1"`,
which a query selecting `le="1"` would miss), `_created` series Go never has, `_count` before
`_sum`, and HELP/TYPE lines for families that have no series yet. This writer takes the samples
from the registry and prints them as `expfmt` (prometheus/common, text_create.go) does:

* families sorted by name, series within a family sorted by label values, label names sorted;
* counters named with their `_total`; histogram series as `_bucket`... then `_sum`, `_count`;
* numbers through `agent.goformat.format_float`; HELP escapes `\\` and newlines, label values
  also `"`;
* a family with no series is not written at all (a CounterVec before its first increment).

`CONTENT_TYPE` is what client_golang's handler answers a plain scrape with.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from agent.goformat import format_float

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8; escaping=underscores"

_SKIP_SUFFIXES = ("_created",)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _family_name(metric: Metric) -> str:
    if metric.type == "counter" and not metric.name.endswith("_total"):
        return metric.name + "_total"
    return metric.name


def _series_key(sample: Sample, family: Metric) -> tuple[str, ...]:
    labels = {k: v for k, v in sample.labels.items() if k != "le"}
    return tuple(f"{k}={labels[k]}" for k in sorted(labels))


def _histogram_lines(name: str, samples: list[Sample], family: Metric) -> list[str]:
    series: dict[tuple[str, ...], dict[str, list[Sample]]] = {}
    for s in samples:
        parts = series.setdefault(_series_key(s, family), {"_bucket": [], "_sum": [], "_count": []})
        for suffix in parts:
            if s.name == name + suffix:
                parts[suffix].append(s)
    out = []
    for key in sorted(series):
        parts = series[key]
        buckets = sorted(parts["_bucket"], key=lambda s: float(s.labels["le"]))
        for b in buckets:
            labels = dict(b.labels)
            le = format_float(float(labels.pop("le")))
            inner = _labels(labels)
            le_part = f'le="{le}"'
            label_text = "{" + (inner[1:-1] + "," if inner else "") + le_part + "}"
            out.append(f"{name}_bucket{label_text} {format_float(b.value)}")
        for suffix in ("_sum", "_count"):
            for s in parts[suffix]:
                out.append(f"{name}{suffix}{_labels(s.labels)} {format_float(s.value)}")
    return out


def render(registry: CollectorRegistry) -> bytes:
    """Every family of `registry`, in Go's text exposition format."""
    families: dict[str, Metric] = {}
    for metric in registry.collect():
        families.setdefault(_family_name(metric), metric)
    lines: list[str] = []
    for name in sorted(families):
        lines += family_lines(families[name])
    return ("".join(line + "\n" for line in lines)).encode()


def family_lines(metric: Metric) -> list[str]:
    """One family's HELP, TYPE and series lines (nothing when it has no series)."""
    name = _family_name(metric)
    samples = [s for s in metric.samples if not s.name.endswith(_SKIP_SUFFIXES)]
    if not samples:
        return []
    kind = metric.type if metric.type in ("counter", "gauge", "histogram", "summary") else "untyped"
    head = [f"# HELP {name} {_escape_help(metric.documentation)}", f"# TYPE {name} {kind}"]
    if metric.type == "histogram":
        return head + _histogram_lines(name, samples, metric)
    body = sorted(samples, key=lambda s: tuple(f"{k}={s.labels[k]}" for k in sorted(s.labels)))
    return head + [f"{s.name}{_labels(s.labels)} {format_float(s.value)}" for s in body]


def sample_names(registry: CollectorRegistry) -> Iterable[str]:
    """Family names as a scrape shows them (counters with `_total`)."""
    return sorted({_family_name(m) for m in registry.collect()})
