"""A complete list of one kind, against what was delivered before -> ADDED / MODIFIED / DELETED events.

The event contract (agent/sources/base.py) has no "replace everything": a source that reads the
whole set again (the file source on every change, the API source after `410 Gone`) delivers only
the differences, so downstream trackers see exactly the objects that changed and nothing is
flushed. Deletions carry the last delivered state of the object.

Pure. Objects are compared by value (`!=` on JSON data, bounded in depth by the decoder).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.sources.base import EventType, Kind, ObjectEvent

Obj = Mapping[str, Any]


def relist_events(kind: Kind, delivered: Mapping[str, Obj], listed: Mapping[str, Obj]) -> list[ObjectEvent]:
    """Deletions first (in delivered order), then additions and changes (in listed order)."""
    events = [
        ObjectEvent(kind, EventType.DELETED, key, obj) for key, obj in delivered.items() if key not in listed
    ]
    for key, obj in listed.items():
        before = delivered.get(key)
        if before is None:
            events.append(ObjectEvent(kind, EventType.ADDED, key, obj))
        elif before != obj:
            events.append(ObjectEvent(kind, EventType.MODIFIED, key, obj))
    return events
