"""A malformed or conflicting object left out of the proxy state, and text safe to log.

Every caller-controlled string (object names, field values quoted in a reason) reaches log lines,
Kubernetes Events and metric labels through `Problem`, so `printable` escapes control characters
here once: a name holding a newline cannot forge a second log line.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_TEXT = 200  # characters of one caller-controlled value kept in a message


def printable(value: object, limit: int = _MAX_TEXT) -> str:
    """`value` as one line of printable text: control characters as escapes, long text cut."""
    text = value if isinstance(value, str) else repr(value)
    out = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return out if len(out) <= limit else out[:limit] + f"...({len(out) - limit} more)"


@dataclass(frozen=True)
class Problem:
    """An object (or one port of it) left out of the state, and why.

    `kind` is "Service", "EndpointSlice" or "Node"; `namespace` and `name` as the object gave them
    (escaped when printed). The reason is written by our code and may quote values with `printable`.
    `refusal` is empty when the object (or port) is left out whole; otherwise only some of its
    frontends are refused (agent/model/guard.py) and it names the refusal, the Event's reason
    (`RefusedExternalIP`, `RefusedNodePort`).
    """

    kind: str
    namespace: str
    name: str
    reason: str
    refusal: str = ""

    @property
    def ref(self) -> str:
        """`Service ns/name` for log lines and events (escaped)."""
        return f"{self.kind} {printable(self.namespace)}/{printable(self.name)}"

    def __str__(self) -> str:
        return f"{self.ref}: {self.reason}"
