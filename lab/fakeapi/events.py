"""Event validation and merge patches as kube-apiserver applies them to events.k8s.io/v1.

`validate_v1_event` follows upstream's `ValidateEventCreate` for requests through
events.k8s.io/v1 (pkg/apis/core/validation/events.go): eventTime required, type Normal or Warning,
the deprecated fields unset (including `deprecatedSource`), reportingController a qualified name,
reportingInstance/action/reason required and at most 128 characters, note at most 1024, a
cluster-scoped `regarding` only from the `default` or `kube-system` namespace, series count >= 2
with a lastObservedTime. The name must be a DNS subdomain (ValidateObjectMeta).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _str(obj: Mapping[str, Any], key: str) -> str:
    value = obj.get(key)
    return value if isinstance(value, str) else ""


def validate_v1_event(event: Mapping[str, Any]) -> list[str]:
    errors: list[str] = []
    meta = event.get("metadata") if isinstance(event.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name, namespace = _str(meta, "name"), _str(meta, "namespace")
    if not name:
        errors.append("metadata.name: Required value: name or generateName is required")
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        errors.append(
            f'metadata.name: Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of ...'
        )
    if not _str(event, "eventTime"):
        errors.append("eventTime: Required value")
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(f'type: Invalid value: "": has invalid value: {event.get("type")}')
    for deprecated in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp"):
        if event.get(deprecated):
            errors.append(f'{deprecated}: Invalid value: "": needs to be unset')
    if event.get("deprecatedCount"):
        errors.append('count: Invalid value: "": needs to be unset')
    source = event.get("deprecatedSource")
    if isinstance(source, Mapping) and (source.get("component") or source.get("host")):
        errors.append('source: Invalid value: "": needs to be unset')
    regarding = event.get("regarding") if isinstance(event.get("regarding"), Mapping) else {}
    assert isinstance(regarding, Mapping)
    if not _str(regarding, "namespace") and namespace not in ("default", "kube-system"):
        errors.append("involvedObject.namespace: Invalid value: does not match event.namespace")
    controller = _str(event, "reportingController")
    if not controller:
        errors.append("reportingController: Required value")
    elif not _QUALIFIED.match(controller) or len(controller.split("/")[-1]) > 63:
        errors.append(f'reportingController: Invalid value: "{controller}"')
    for field, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
        value = _str(event, field)
        if not value:
            errors.append(f"{field}: Required value")
        elif len(value) > limit:
            errors.append(f'{field}: Invalid value: "": can have at most {limit} characters')
    if len(_str(event, "note")) > 1024:
        errors.append('message: Invalid value: "": can have at most 1024 characters')
    series = event.get("series")
    if isinstance(series, Mapping):
        count = series.get("count")
        if not isinstance(count, int) or count < 2:
            errors.append('series.count: Invalid value: "": should be at least 2')
        if not _str(series, "lastObservedTime"):
            errors.append("series.lastObservedTime: Required value")
    if namespace and not _DNS_SUBDOMAIN.match(namespace):
        errors.append(f'namespace: Invalid value: "{namespace}"')
    return errors


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null deletes a key; objects merge; anything else replaces)."""
    if not isinstance(patch, Mapping):
        return patch
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
