"""The API server's field rules, as small functions that raise ParseError naming the field.

`parse.py` reads Services and EndpointSlices through these so that it can stay a readable list
of "what the API server requires here"; this module holds the rules themselves:

* Typed readers (`opt_map`, `opt_str`, `opt_int32`, ...): the JSON shape Go would decode. An
  absent key and JSON null are the same (Go's zero value or nil pointer); a value of the wrong type
  is refused, as the API server's decoder refuses it. Integers are int32 unless said otherwise;
  booleans are never integers and integers are never booleans; floats are never integers.
* Names, from k8s.io/apimachinery/pkg/util/validation/validation.go: DNS-1123 label and
  subdomain, DNS-1035 label, qualified name (label keys), label value, IANA_SVC_NAME (named
  target ports), fully qualified domain name (FQDN EndpointSlices).
* `ParseError` and `invalid(path, detail)`: every failure reads `<field path>: <what would be
  right>`, quoting the offending value through `describe`, which never prints more than a
  bounded, escaped excerpt: a 5,000-digit integer becomes "an integer of 16,610 bits" (Python
  refuses to print it anyway), a name holding a newline is escaped (`agent.model.problem.printable`),
  a nested list becomes "a list of 3 items".

Nothing here raises anything but ParseError, whatever the input, and nothing recurses into
caller data, so deep nesting costs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.model.problem import printable
from agent.sources.base import JSON_MAP_TYPES

# Go's int32, the type of every port, nodePort and timeout in the API.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_QUOTE_LIMIT = 80  # characters of a caller's string quoted in a message


class ParseError(ValueError):
    """A Kubernetes object this proxy cannot program; the message says which field and why."""


def invalid(path: str, detail: str) -> ParseError:
    return ParseError(f"{path}: {detail}")


def describe(value: object) -> str:
    """A short, printable description of any JSON value, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        bits = value.bit_length()
        return str(value) if bits <= 64 else f"an integer of {bits:,} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f'"{printable(value, _QUOTE_LIMIT)}"'
    if isinstance(value, JSON_MAP_TYPES):
        return f"a map of {len(value)} key{'' if len(value) == 1 else 's'}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    return f"a {printable(type(value).__name__, _QUOTE_LIMIT)}"


# ---- typed readers -----------------------------------------------------------------------------


def require_map(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, JSON_MAP_TYPES):
        raise invalid(path, f"must be a map, not {describe(value)}")
    return value


def opt_map(obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
    value = obj.get(key)
    return None if value is None else require_map(value, path)


def opt_list(obj: Mapping[str, Any], key: str, path: str) -> Sequence[Any]:
    """A list, [] when absent or null."""
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise invalid(path, f"must be a list, not {describe(value)}")
    return value


def require_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise invalid(path, f"must be a string, not {describe(value)}")
    return value


def opt_str(obj: Mapping[str, Any], key: str, path: str) -> str:
    """A string, "" when absent or null (Go's zero value)."""
    value = obj.get(key)
    return "" if value is None else require_str(value, path)


def opt_bool(obj: Mapping[str, Any], key: str, path: str) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise invalid(path, f"must be true, false or absent, not {describe(value)}")


def require_int(value: Any, path: str, low: int = INT32_MIN, high: int = INT32_MAX) -> int:
    """An integer in [low, high]; the message gives the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(path, f"must be an integer, not {describe(value)}")
    if not low <= value <= high:
        raise invalid(path, f"{describe(value)} is out of range {low}-{high}")
    return value


def opt_int(obj: Mapping[str, Any], key: str, path: str, low: int = INT32_MIN, high: int = INT32_MAX) -> int:
    """An integer in [low, high], 0 when absent or null (Go's zero value)."""
    value = obj.get(key)
    return 0 if value is None else require_int(value, path, low, high)


def one_of(value: str, allowed: Sequence[str], path: str) -> str:
    if value not in allowed:
        raise invalid(path, f"{describe(value)} is not supported: must be one of {', '.join(allowed)}")
    return value


# ---- names (k8s.io/apimachinery/pkg/util/validation) -------------------------------------------

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_IANA_SVC_NAME = re.compile(r"[-a-z0-9]+")

DNS1123_LABEL_RULE = (
    "must be a DNS-1123 label: at most 63 characters, lower-case letters, digits and '-', "
    "starting and ending with a letter or digit"
)
DNS1123_SUBDOMAIN_RULE = (
    "must be a DNS-1123 subdomain: at most 253 characters, lower-case letters, digits, '-' and '.', "
    "starting and ending with a letter or digit"
)
DNS1035_LABEL_RULE = (
    "must be a DNS-1035 label: at most 63 characters, lower-case letters, digits and '-', "
    "starting with a letter and ending with a letter or digit"
)
LABEL_VALUE_RULE = (
    "must be a label value: empty, or at most 63 characters of letters, digits, '-', '_' and '.', "
    "starting and ending with a letter or digit"
)
QUALIFIED_NAME_RULE = (
    "must be a qualified name: an optional DNS-1123 subdomain prefix and '/', then at most 63 "
    "characters of letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
)
IANA_SVC_NAME_RULE = (
    "must be a port number 1-65535 or an IANA_SVC_NAME: at most 15 lower-case letters, digits and '-', "
    "at least one letter, no '-' at either end or twice in a row"
)


def is_dns1123_label(value: str) -> bool:
    return len(value) <= 63 and _DNS1123_LABEL.fullmatch(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(value) is not None


def is_dns1035_label(value: str) -> bool:
    return len(value) <= 63 and _DNS1035_LABEL.fullmatch(value) is not None


def is_label_value(value: str) -> bool:
    return value == "" or (len(value) <= 63 and _QUALIFIED_NAME.fullmatch(value) is not None)


def is_qualified_name(value: str) -> bool:
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or not is_dns1123_subdomain(prefix) or "/" in prefix):
        return False
    return 0 < len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None


def is_iana_svc_name(value: str) -> bool:
    """IsValidPortName: the name a named targetPort (and a container port) carries."""
    return (
        0 < len(value) <= 15
        and _IANA_SVC_NAME.fullmatch(value) is not None
        and any("a" <= c <= "z" for c in value)
        and "--" not in value
        and not value.startswith("-")
        and not value.endswith("-")
    )


def is_fqdn(value: str) -> bool:
    """IsFullyQualifiedDomainName: a DNS-1123 subdomain of two labels or more (a final dot allowed)."""
    name = value[:-1] if value.endswith(".") else value
    return is_dns1123_subdomain(name) and "." in name


def check_name(value: str, path: str, ok: bool, rule: str) -> str:
    if not ok:
        raise invalid(path, f"{describe(value)} is not valid: {rule}")
    return value


def labels(meta: Mapping[str, Any], path: str) -> Mapping[str, str]:
    """metadata.labels as the API server validates them (ValidateLabels): keys and values."""
    value = opt_map(meta, "labels", path)
    if value is None:
        return {}
    for key, text in value.items():
        if key not in _LABEL_KEYS:
            if not isinstance(key, str) or not is_qualified_name(key):
                raise invalid(path, f"key {describe(key)} is not valid: {QUALIFIED_NAME_RULE}")
            if len(_LABEL_KEYS) < _LABEL_KEYS_MAX:
                _LABEL_KEYS.add(key)
        if type(text) is not str or not is_label_value(text):
            where = f"{path}[{printable(key)}]"  # built for the error alone
            check_name(require_str(text, where), where, is_label_value(text), LABEL_VALUE_RULE)
    return value


# Label keys found valid: a cluster's objects use the same few keys a hundred thousand times
# (bounded: past the limit, new keys are checked each time).
_LABEL_KEYS: set[str] = set()
_LABEL_KEYS_MAX = 4096
