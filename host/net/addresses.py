"""Which IP addresses are global, and what each other one is (loopback, private, link-local, the
cloud metadata address, documentation space, ...), including the IPv4 an IPv4-mapped, 6to4, Teredo
or NAT64 address leads to. host/net/policy.py refuses a URL that resolves to a non-global address
unless the operator named it.
"""

from __future__ import annotations

import ipaddress

__all__ = ["Address", "Network", "canonical", "is_loopback", "non_global"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_V4_KINDS: list[tuple[ipaddress.IPv4Network, str]] = [
    (ipaddress.IPv4Network(net), kind)
    for net, kind in [
        ("0.0.0.0/8", "an unspecified ('this network') address"),
        ("127.0.0.0/8", "a loopback address"),
        ("169.254.169.254/32", "the cloud metadata address"),
        ("169.254.0.0/16", "a link-local address"),
        ("10.0.0.0/8", "a private address"),
        ("172.16.0.0/12", "a private address"),
        ("192.168.0.0/16", "a private address"),
        ("100.64.0.0/10", "a shared (carrier-grade NAT) address"),
        ("198.18.0.0/15", "a benchmarking address"),
        ("192.0.2.0/24", "a documentation address"),
        ("198.51.100.0/24", "a documentation address"),
        ("203.0.113.0/24", "a documentation address"),
        ("192.0.0.0/24", "an IETF protocol-assignment address"),
        ("192.88.99.0/24", "a 6to4 relay anycast address"),
        ("224.0.0.0/4", "a multicast address"),
        ("240.0.0.0/4", "a reserved address"),
    ]
]
_V6_KINDS: list[tuple[ipaddress.IPv6Network, str]] = [
    (ipaddress.IPv6Network(net), kind)
    for net, kind in [
        ("::/128", "an unspecified address"),
        ("::1/128", "a loopback address"),
        ("::/96", "a deprecated IPv4-compatible address"),
        ("fd00:ec2::254/128", "the cloud metadata address"),
        ("fe80::/10", "a link-local address"),
        ("fec0::/10", "a site-local address"),
        ("fc00::/7", "a private (unique local) address"),
        ("ff00::/8", "a multicast address"),
        ("2001:db8::/32", "a documentation address"),
        ("3fff::/20", "a documentation address"),
        ("2001:2::/48", "a benchmarking address"),
        ("2001::/32", "a Teredo address"),
        ("64:ff9b:1::/48", "a local-use NAT64 address"),
        ("100::/64", "a discard-only address"),
    ]
]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
_V6_LOOPBACK = ipaddress.IPv6Address("::1")


def canonical(text: str) -> Address:
    """The address `text` names, zone id stripped and IPv4-mapped IPv6 unwrapped to IPv4."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _embedded_v4(ip: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """IPv4 addresses that 6to4, Teredo and NAT64 forms of `ip` lead to."""
    found: list[tuple[str, ipaddress.IPv4Address]] = []
    if ip.sixtofour is not None:
        found.append(("6to4", ip.sixtofour))
    if ip.teredo is not None:
        server, client = ip.teredo
        found += [("Teredo", server), ("Teredo", client)]
    if ip in _NAT64:
        found.append(("NAT64", ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
    return found


def non_global(ip: Address) -> str | None:
    """Why `ip` is not a global address (e.g. 'a private address'), or None when it is global."""
    if isinstance(ip, ipaddress.IPv4Address):
        for net4, kind in _V4_KINDS:
            if ip in net4:
                return kind
        return None if ip.is_global else "a special-purpose (non-global) address"
    for label, inner in _embedded_v4(ip):
        why = non_global(inner)
        if why is not None:
            return f"a {label} form of {inner}, {why}"
    if ip in _NAT64:  # the embedded IPv4 is global; Python counts 64:ff9b::/96 as reserved
        return None
    for net6, kind in _V6_KINDS:
        if ip in net6:
            return kind
    if ip.is_reserved or ip.is_multicast or ip.is_site_local:
        return "a reserved address"
    return None if ip.is_global else "a special-purpose (non-global) address"


def is_loopback(ip: Address) -> bool:
    return ip in _V4_LOOPBACK if isinstance(ip, ipaddress.IPv4Address) else ip == _V6_LOOPBACK
