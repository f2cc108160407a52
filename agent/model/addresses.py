"""IP addresses and CIDRs read the way Kubernetes reads them, written back in canonical form.

The API server and kube-proxy parse addresses with `netutils.ParseIPSloppy` / `ParseCIDRSloppy`
(k8s.io/utils/net, a fork of Go 1.16's parser kept for objects stored before Go 1.17 refused
leading zeros). Python's `ipaddress` refuses leading zeros and reads other text differently, so
this module transcribes the Go rules instead:

* IPv4: four dot-separated decimal fields, each of ASCII digits worth at most 255; leading zeros
  are allowed and mean nothing (`172.30.0.041` is 172.30.0.41, decimal, never octal).
* IPv6: Go's syntax, hex groups with leading zeros allowed, an IPv4 tail (itself sloppy), no zone
  (`%eth0`). An IPv4-mapped IPv6 address (`::ffff:10.0.0.1`) is an IPv4 address, as Go's
  `To4()` (and so every family check in kube-proxy) says.
* CIDR: a sloppy address, `/`, a decimal prefix length within the family's bits; host bits are
  allowed (`10.0.0.1/8`) and dropped, as kube-proxy's `*net.IPNet` does.

Every parser returns None for text it does not accept, never raises, and costs time linear in the
text (a field of 5,000 zeros included). Callers keep the `ipaddress` object and print it with
`str()`, so renderers only ever see canonical dotted quads and canonical CIDRs.

Also here: `special_ip_reason`, the API server's `ValidateNonSpecialIP` / `ValidateEndpointIP`
(pkg/apis/core/validation/validation.go), which externalIPs and endpoint addresses must pass.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_HEX = frozenset("0123456789abcdefABCDEF")


def _decimal(text: str, maximum: int) -> int | None:
    """Go's `dtoi` as ParseIPSloppy uses it: ASCII digits only, leading zeros free, <= maximum."""
    if not (text.isascii() and text.isdigit()):
        return None
    if len(text) > 3:  # only leading zeros may make it longer (int() of 5,000 digits would raise)
        text = text.lstrip("0") or "0"
        if len(text) > 3:
            return None
    value = int(text)
    return value if value <= maximum else None


def _ipv4_int(text: str) -> int | None:
    fields = text.split(".")
    if len(fields) != 4:
        return None
    value = 0
    for field in fields:
        octet = _decimal(field, 255)
        if octet is None:
            return None
        value = value << 8 | octet
    return value


def _ipv6(text: str) -> ipaddress.IPv6Address | None:
    """Go's IPv6 syntax through Python's parser, after the rewrites Go allows and Python does not."""
    if text.count("::") > 1 or not set(text) <= _HEX | {":", "."}:
        return None
    groups = text.split(":")
    if "." in groups[-1]:
        tail = _ipv4_int(groups[-1])
        if tail is None:
            return None
        groups[-1:] = [f"{tail >> 16:x}", f"{tail & 0xFFFF:x}"]
    for i, group in enumerate(groups):
        if "." in group:  # an IPv4 part anywhere but last
            return None
        if len(group) > 4:  # Go allows leading zeros in a group; its value must fit 16 bits
            trimmed = group.lstrip("0") or "0"
            if len(trimmed) > 4:
                return None
            groups[i] = trimmed
    try:
        return ipaddress.IPv6Address(":".join(groups))
    except ValueError:
        return None


def parse_ip_sloppy(text: str) -> IPAddress | None:
    """`netutils.ParseIPSloppy`, with Go's `To4()` applied: the address, or None."""
    if "." in text and ":" not in text:
        value = _ipv4_int(text)
        return None if value is None else ipaddress.IPv4Address(value)
    if ":" not in text:
        return None
    v6 = _ipv6(text)
    if v6 is None:
        return None
    return v6.ipv4_mapped or v6


def parse_cidr_sloppy(text: str) -> IPNetwork | None:
    """`netutils.ParseCIDRSloppy`: the network (host bits cleared), or None.

    The family is the text's (a colon makes it IPv6), as Go sizes the mask by the text.
    """
    address, slash, prefix_text = text.partition("/")
    if not slash:
        return None
    if ":" in address:
        v6 = _ipv6(address)
        prefix = _decimal(prefix_text, 128)
        if v6 is None or prefix is None:
            return None
        return ipaddress.IPv6Network((v6, prefix), strict=False)
    value = _ipv4_int(address)
    prefix = _decimal(prefix_text, 32)
    if value is None or prefix is None:
        return None
    return ipaddress.IPv4Network((value, prefix), strict=False)


def special_ip_reason(ip: IPAddress) -> str | None:
    """Why the API server refuses `ip` as an external IP or endpoint address, or None."""
    if ip.is_unspecified:
        return "may not be unspecified (0.0.0.0, ::)"
    if ip.is_loopback:
        return "may not be in the loopback range (127.0.0.0/8, ::1/128)"
    value = int(ip)
    if isinstance(ip, ipaddress.IPv4Address):
        if value >> 16 == 0xA9FE:  # 169.254.0.0/16
            return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
        if value >> 8 == 0xE00000:  # 224.0.0.0/24
            return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
        return None
    if value >> 118 == 0x3FA:  # fe80::/10
        return "may not be in the link-local range (169.254.0.0/16, fe80::/10)"
    if value >> 120 == 0xFF and (value >> 112) & 0x0F == 0x02:  # Go's IsLinkLocalMulticast: ffx2::/16
        return "may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)"
    return None
