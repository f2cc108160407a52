"""How Go spells durations, floats and times, since clients parse kube-proxy's text byte for byte.

kube-proxy is a Go program, and the text it writes comes out of Go's standard library:

* durations (`--iptables-sync-period=30s`, `syncPeriod: 1h0m0s` in a KubeProxyConfiguration) are
  `time.ParseDuration` / `time.Duration.String` (go/src/time/format.go);
* numbers in the Prometheus exposition are `strconv.AppendFloat(f, 'g', -1, 64)` with the
  special cases of `expfmt.writeFloat` (prometheus/common expfmt/text_create.go): `1e+06`, not
  `1000000.0`, and `le="1"`, not `le="1.0"`;
* times in the /healthz JSON are `time.Time.MarshalJSON`: RFC 3339 with nanoseconds, trailing
  zeros of the fraction dropped (`2024-05-01T10:00:00.5Z`).

Pure functions, no dependencies; durations are floats of seconds everywhere else in the agent.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from decimal import Decimal

# ------------------------------------------------------------------------------------ durations

_UNITS_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000, "s": 10**9}
_UNITS_NS |= {"m": 60 * 10**9, "h": 3600 * 10**9}
_NUMBER = re.compile(r"(\d*)(?:\.(\d*))?")
_UNIT = re.compile(r"[^0-9.]*")
_MAX_NS = 2**63 - 1
_HINT = "a number with a unit: ns, us, ms, s, m, h (e.g. 30s, 1m30s, 500ms)"


class DurationError(ValueError):
    """Not a Go duration; the message says what is allowed."""


def parse_duration(text: str) -> float:
    """Seconds from a Go duration (`30s`, `1m30s`, `1h0m0s`, `250ms`, `-1.5h`, `0`).

    As `time.ParseDuration`: an optional sign, then one or more decimal numbers each followed by
    a unit (ns, us, µs, ms, s, m, h). A bare `0` is the only number allowed without a unit.
    """
    s = text
    neg = s[:1] == "-"
    if s[:1] in ("-", "+"):
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise DurationError(f"invalid duration {text!r}: expected {_HINT}")
    total = Decimal(0)
    while s:
        num = _NUMBER.match(s)
        assert num is not None  # the pattern matches the empty string
        whole, frac = num.group(1), num.group(2) or ""
        if not whole and not frac:
            raise DurationError(f"invalid duration {text!r}: expected {_HINT}")
        s = s[num.end() :]
        unit_match = _UNIT.match(s)
        unit = unit_match.group(0) if unit_match else ""
        if not unit:
            raise DurationError(f"missing unit in duration {text!r}: expected {_HINT}")
        if unit not in _UNITS_NS:
            raise DurationError(f"unknown unit {unit!r} in duration {text!r}: expected {_HINT}")
        total += Decimal(f"{whole or 0}.{frac or 0}") * _UNITS_NS[unit]
        s = s[len(unit) :]
    if total > _MAX_NS:
        raise DurationError(f"invalid duration {text!r}: larger than Go's maximum (about 292 years)")
    ns = int(total)
    return float(-ns if neg else ns) / 1e9


def _frac(value: int, digits: int) -> str:
    """`value` (< 10**digits) as a decimal fraction without trailing zeros: 500 ms -> '.5'."""
    text = str(value).rjust(digits, "0").rstrip("0")
    return "." + text if text else ""


def format_duration(seconds: float) -> str:
    """`time.Duration.String`: `0s`, `500ms`, `1.5s`, `1m0s`, `24h0m0s`, `1µs`, `-30s`."""
    ns = round(seconds * 1e9)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u < 1_000_000_000:
        # Under a second Go picks the largest unit that keeps an integer part: ns, µs or ms.
        if u < 1_000:
            return f"{sign}{u}ns"
        if u < 1_000_000:
            return f"{sign}{u // 1_000}{_frac(u % 1_000, 3)}µs"
        return f"{sign}{u // 1_000_000}{_frac(u % 1_000_000, 6)}ms"
    secs, frac = divmod(u, 1_000_000_000)
    text = f"{secs % 60}{_frac(frac, 9)}s"
    minutes = secs // 60
    if minutes:
        text = f"{minutes % 60}m{text}"
        hours = minutes // 60
        if hours:
            text = f"{hours}h{text}"
    return sign + text


# --------------------------------------------------------------------------------------- floats


def format_float(value: float) -> str:
    """A sample value or `le` bound as Go's Prometheus client writes it (shortest round trip)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    # repr gives the shortest digits that round-trip, as strconv's 'g' with precision -1 does.
    sign, digits, exp = Decimal(repr(float(value))).normalize().as_tuple()
    assert isinstance(exp, int)
    mantissa = "".join(map(str, digits))
    point = len(mantissa) + exp  # decimal point position relative to the first digit
    x = point - 1  # the exponent in d.ddd e x form
    out = "-" if sign else ""
    # strconv.FormatFloat(f, 'g', -1, 64): with the shortest precision Go switches to %e when the
    # exponent is below -4 or at least 6 ("if shortest { eprec = 6 }"), so 1234567 prints as
    # 1.234567e+06 and a Unix time as 1.7e+09, as in any scrape of a Go program.
    if x < -4 or x >= 6:
        tail = mantissa[1:]
        body = mantissa[0] + ("." + tail if tail else "")
        return f"{out}{body}e{'-' if x < 0 else '+'}{abs(x):02d}"
    if point <= 0:
        return f"{out}0.{'0' * -point}{mantissa}"
    if point >= len(mantissa):
        return f"{out}{mantissa}{'0' * (point - len(mantissa))}"
    return f"{out}{mantissa[:point]}.{mantissa[point:]}"


# ---------------------------------------------------------------------------------------- times


def format_time(unix_ns: int) -> str:
    """`time.Time.MarshalJSON` (RFC 3339, nanoseconds, no trailing zeros) for a UTC time.

    0 stands for Go's zero time (`0001-01-01T00:00:00Z`), which kube-proxy prints before the
    first sync.
    """
    if unix_ns == 0:
        return "0001-01-01T00:00:00Z"
    secs, frac = divmod(unix_ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(secs, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}{_frac(frac, 9)}Z"
