"""Value kinds of the settings table: how one setting's value is read from a flag, read from a
KubeProxyConfiguration file, and written back (`--write-config-to`, /configz).

A kind is the setting's parser and validator. The flag side takes pflag's text (`--x=30s`); the
file side takes what YAML decoded (a string, a number, a list) and checks its type as upstream's
strict decoder would ("must be a whole number"); both raise `ValueError` with a message that says
what is allowed. `dump` turns a value back into the file's form, so a written file read again
gives the same value (the round trip `tests/agent/test_settings.py` checks).

Pure: no I/O, imports nothing of the agent but `goformat`.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.goformat import DurationError, format_duration, parse_duration

NODEPORT_PRIMARY = "primary"  # --nodeport-addresses keyword: the node's primary address


class Kind:
    """Base: a string in both places. Subclasses override what differs."""

    metavar = "STRING"
    boolean = False  # pflag boolean: `--flag` alone means true
    repeatable = False  # every occurrence counts (`combine`), not only the last

    def flag(self, text: str) -> Any:
        return text

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        return self.flag(raw)

    def dump(self, value: Any) -> Any:
        return value

    def show(self, value: Any) -> str:
        """The default as the README and --help print it ("" for none)."""
        dumped = self.dump(value)
        if dumped in (None, "", [], {}, ()):
            return ""
        if isinstance(dumped, bool):
            return "true" if dumped else "false"
        if isinstance(dumped, list):
            return ",".join(str(x) for x in dumped)
        return str(dumped)

    def combine(self, values: Sequence[Any]) -> Any:
        """The value of a repeatable flag given several times."""
        return values[-1]


@dataclass(frozen=True)
class Text(Kind):
    """A string, optionally normalised (`normalize` may raise ValueError)."""

    normalize: Callable[[str], str] | None = None
    metavar: str = "STRING"

    def flag(self, text: str) -> Any:
        return self.normalize(text) if self.normalize else text


_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


class Bool(Kind):
    """pflag's boolean: strconv.ParseBool's spellings on the command line, a YAML bool in a file."""

    metavar = "true|false"
    boolean = True

    def flag(self, text: str) -> Any:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{text!r} is not true or false")

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, bool):
            raise ValueError("must be true or false")
        return raw


# Upstream's integer settings are int32 (a few uint32): a number outside fits no field of theirs.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Int(Kind):
    """A whole number within [lo, hi] (None: only the int32 range)."""

    lo: int | None = None
    hi: int | None = None
    metavar: str = "N"

    def _flag_rule(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"is not a whole number within [{self.lo}, {self.hi}]"
        if self.lo == 1:
            return "is not a positive whole number"
        if self.lo is not None:
            return f"is not a whole number >= {self.lo}"
        return "is not a whole number"

    def flag(self, text: str) -> Any:
        # 20 characters hold any int32 and keep int() from 4,300-digit work (and its own error).
        if not re.fullmatch(r"[+-]?\d{1,19}", text.strip()):
            raise ValueError(f"{text!r} {self._flag_rule()}")
        value = int(text)
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ValueError(f"{text!r} {self._flag_rule()}")
        if not INT32_MIN <= value <= INT32_MAX:
            raise ValueError(f"{text!r} does not fit in 32 bits (within [{INT32_MIN}, {INT32_MAX}])")
        return value

    def file(self, raw: Any) -> Any:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError("must be a whole number")
        if self.lo is not None and self.hi is not None and not self.lo <= raw <= self.hi:
            raise ValueError(f"must be within the range [{self.lo}, {self.hi}]")
        if self.lo is not None and raw < self.lo:
            raise ValueError(f"must be greater than or equal to {self.lo}")
        if not INT32_MIN <= raw <= INT32_MAX:
            raise ValueError(f"must fit in 32 bits (within [{INT32_MIN}, {INT32_MAX}])")
        return raw


@dataclass(frozen=True)
class Prime(Int):
    """A prime within [lo, hi] (a Maglev table size: every backend's offset and skip then walk
    every position)."""

    def flag(self, text: str) -> Any:
        value = super().flag(text)
        if not _is_prime(value):
            raise ValueError(f"{text!r} is not a prime number")
        return value

    def file(self, raw: Any) -> Any:
        value = super().file(raw)
        if not _is_prime(value):
            raise ValueError("must be a prime number")
        return value


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


@dataclass(frozen=True)
class Float(Kind):
    """A number (float32 upstream: `--kube-api-qps`)."""

    metavar: str = "NUMBER"

    def flag(self, text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number (e.g. 5 or 0.5)") from None
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise ValueError(f"{text!r} is not a finite number that fits in 32 bits")
        return value

    def file(self, raw: Any) -> Any:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError("must be a number")
        if not math.isfinite(raw) or abs(raw) > FLOAT32_MAX:
            raise ValueError("must be a finite number that fits in 32 bits")
        return float(raw)

    def dump(self, value: Any) -> Any:
        return int(value) if float(value).is_integer() else value  # Go prints 5, not 5.0


@dataclass(frozen=True)
class Duration(Kind):
    """A Go duration (`30s`, `1m30s`, `500ms`); on the command line a bare number is seconds.

    `zero_is_default`: a zero in the file means "the default", as upstream's defaulting treats a
    zero sync period. `positive`: the file's message for a negative value says "greater than 0".
    `optional`: the value may be None (derived later), and dumps as "0s".
    """

    zero_is_default: bool = False
    positive: bool = False
    metavar: str = "DURATION"
    most: float | None = None  # seconds the value may not exceed (what a field of the data path holds)

    def flag(self, text: str) -> Any:
        try:
            seconds = float(text)
        except ValueError:
            try:
                seconds = parse_duration(text.strip())
            except DurationError as exc:
                raise ValueError(f"{text!r} is not a duration (use e.g. 30s, 1m, 500ms): {exc}") from None
        if seconds < 0:
            raise ValueError(f"{text!r} must not be negative")
        if self.most is not None and seconds > self.most:
            raise ValueError(f"{text!r} is more than {format_duration(self.most)}")
        return seconds

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, str):
            raise ValueError("must be a duration string (e.g. 30s, 1m, 500ms)")
        try:
            seconds = parse_duration(raw)
        except DurationError as exc:
            raise ValueError(str(exc)) from None
        if seconds < 0:
            raise ValueError(
                "must be greater than 0" if self.positive else "must be greater than or equal to 0"
            )
        if self.most is not None and seconds > self.most:
            raise ValueError(f"must be at most {format_duration(self.most)}")
        if seconds == 0 and self.zero_is_default:
            return None
        return seconds

    def dump(self, value: Any) -> Any:
        return format_duration(value or 0.0)


@dataclass(frozen=True)
class Choice(Kind):
    """One of `values`; `file_hint` is the file's message for another value."""

    values: tuple[str, ...] = ()
    file_hint: str = ""
    metavar: str = ""

    def flag(self, text: str) -> Any:
        if text not in self.values:
            allowed = ", ".join(repr(v) for v in self.values)
            raise ValueError(f"invalid choice: {text!r} (choose from {allowed})")
        return text

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        if raw not in self.values:
            raise ValueError(self.file_hint or f"unsupported value; supported values: {self.values}")
        return raw


def csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def cidr_list(values: Iterable[str]) -> tuple[str, ...]:
    out = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError:
            raise ValueError(f"{value!r} is not a CIDR (e.g. 10.244.0.0/16)") from None
        out.append(value)
    return tuple(out)


def nodeport_addresses(values: Iterable[str]) -> tuple[str, ...]:
    """CIDRs and kube-proxy's keywords: `primary` (the node's primary address), `localhost`
    (127.0.0.0/8) and `all` (every address, the same as leaving the list empty)."""
    out: list[str] = []
    every = False
    for value in (v.strip() for v in values):
        if not value:
            continue
        if value == "all":
            every = True
        elif value == "localhost":
            out.append("127.0.0.0/8")
        elif value == NODEPORT_PRIMARY:
            out.append(NODEPORT_PRIMARY)
        else:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(
                    f"{value!r} is not a CIDR or one of primary, localhost, all (e.g. 192.168.0.0/24)"
                ) from None
            out.append(value)
    return () if every else tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class StrList(Kind):
    """A list: comma-separated on the command line, a YAML list in the file (or, `joined`, one
    comma-separated string, as `clusterCIDR`). `check` validates and normalises the items."""

    check: Callable[[Iterable[str]], tuple[str, ...]] | None = None
    joined: bool = False
    null_when_empty: bool = True  # the document writes [] as null, as Go writes a nil slice
    metavar: str = "A,B,..."

    def _items(self, items: Iterable[str]) -> tuple[str, ...]:
        return self.check(items) if self.check else tuple(x.strip() for x in items if x.strip())

    def flag(self, text: str) -> Any:
        return self._items(text.split(","))

    def file(self, raw: Any) -> Any:
        if self.joined:
            if not isinstance(raw, str):
                raise ValueError("must be a string")
            return self._items(raw.split(","))
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise ValueError("must be a list of strings")
        return self._items(raw)

    def dump(self, value: Any) -> Any:
        if self.joined:
            return ",".join(value)
        return list(value) or (None if self.null_when_empty else [])


def bind_address(text: str, default_port: int) -> str:
    """`IP`, `IP:port` or `[IPv6]:port`; a bare IP gets the default port (upstream's
    AppendPortIfNeeded). "" stays "" (the server is off)."""
    text = text.strip()
    if not text:
        return ""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        pass
    else:
        return f"[{ip}]:{default_port}" if ip.version == 6 else f"{ip}:{default_port}"
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not IP or IP:port (e.g. 0.0.0.0:{default_port})")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address (e.g. 0.0.0.0:{default_port})") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: {port!r} is not a port (1-65535)")
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass(frozen=True)
class BindAddress(Kind):
    """IP[:port] of a server. On the command line "" turns it off; in a file "" means the default
    address, as upstream's defaulting fills it."""

    port: int = 0
    default: str = ""
    metavar: str = "IP[:PORT]"

    def flag(self, text: str) -> Any:
        return bind_address(text, self.port)

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        return bind_address(raw, self.port) or self.default


@dataclass(frozen=True)
class IPAddress(Kind):
    """One IP address; `v4_only` for the agent's own IPv4 flags; `repeatable` collects them all."""

    v4_only: bool = False
    repeatable: bool = False
    metavar: str = "IP"

    def flag(self, text: str) -> Any:
        try:
            ip = ipaddress.IPv4Address(text) if self.v4_only else ipaddress.ip_address(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an {'IPv4' if self.v4_only else 'IP'} address") from None
        return str(ip)

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, str):
            raise ValueError("must be a string")
        ipaddress.ip_address(raw)  # ValueError names the value
        return raw

    def combine(self, values: Sequence[Any]) -> Any:
        return tuple(values) if self.repeatable else values[-1]


@dataclass(frozen=True)
class PortRange(Kind):
    """`lo-hi` within [1024, 65535]."""

    metavar: str = "LO-HI"

    def flag(self, text: str) -> Any:
        m = re.fullmatch(r"(\d+)-(\d+)", text)
        if not m or not 1024 <= int(m[1]) <= int(m[2]) <= 65535:
            raise ValueError(f"{text!r} is not a port range like 61000-65535 (within 1024-65535)")
        return int(m[1]), int(m[2])

    def dump(self, value: Any) -> Any:
        return f"{value[0]}-{value[1]}"


class BoolMap(Kind):
    """Feature gates: `Name=true,Other=false` (cliflag.MapStringBool: pairs split on commas,
    each value strconv.ParseBool) on the command line, a map of booleans in a file. Given twice on
    the command line, the pairs add up, as pflag's Set does."""

    metavar = "Name=true|false,..."
    repeatable = True

    def flag(self, text: str) -> Any:
        out: dict[str, bool] = {}
        for pair in text.split(","):
            if not pair.strip():
                continue
            name, sep, value = pair.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not name:
                raise ValueError(f"{pair!r} is not Name=true|false (e.g. AllAlpha=false)")
            if value in _TRUE:
                out[name] = True
            elif value in _FALSE:
                out[name] = False
            else:
                raise ValueError(f"{pair!r}: {value!r} is not true or false")
        return out

    def file(self, raw: Any) -> Any:
        if not isinstance(raw, Mapping) or not all(isinstance(v, bool) for v in raw.values()):
            raise ValueError("must be a map of names to true or false")
        return {str(k): v for k, v in raw.items()}

    def combine(self, values: Sequence[Any]) -> Any:
        out: dict[str, bool] = {}
        for v in values:
            out.update(v)
        return out

    def show(self, value: Any) -> str:
        return ",".join(f"{k}={'true' if v else 'false'}" for k, v in sorted(value.items()))


class Opaque(Kind):
    """Any YAML value, kept as written (fields this agent never reads: `logging.options`)."""

    def file(self, raw: Any) -> Any:
        return raw
