"""Which URLs an inferlet may fetch, and which address the request must connect to.

The operator opens outbound HTTP with `--http-allow HOST[:PORT]` (repeatable); with no entry it is
off. The `http` WIT import (host/api/http.py) calls `HttpPolicy.check(url)` before every request
and connects to the returned `Target.address`, never re-resolving the name, so DNS rebinding cannot
move a checked request elsewhere.

Pattern HOST forms and what they allow (PORT is 1-65535 or `*`; absent means any port):

- `*`, `*.example.com` (subdomains only), `example.com` (exact name): the URL's host must match
  (IP-literal URLs match only `*`), and every address it resolves to must be *global*: never
  loopback, private, link-local (including the cloud metadata addresses), unspecified, multicast,
  reserved, shared, benchmarking or documentation space, nor an IPv4-mapped, 6to4, Teredo or
  NAT64 form of any of those.
- `localhost`: the host `localhost`, resolving to loopback addresses only.
- `10.0.0.5`, `[fd00::1]`, `10.0.0.0/8`, `[fd00::/8]`: any URL whose resolved addresses lie inside,
  whatever kind of address they are; the operator named them explicitly.

Every resolved address must be allowed, since the connector could pick any of them. Checks act on
resolved, canonical addresses (`ipaddress`; which are global: host/net/addresses.py), never on the
URL's spelling: `http://2130706433/`, `http://0x7f.1/` and `http://[::ffff:7f00:1]/` are all 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from host.net.addresses import Address, Network, canonical, is_loopback, non_global

Resolver = Callable[[str, int], list[str]]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_SYNTAX = (
    "expected HOST[:PORT] where HOST is *, *.example.com, example.com, localhost, an IPv4 address, "
    "an [IPv6] address or a CIDR such as 10.0.0.0/8 or [fd00::/8], and PORT is 1-65535 or *"
)
# A host whose last label is a number is an IPv4 address in some spelling (decimal, octal, hex, 1-4 parts:
# what inet_aton and getaddrinfo accept), never a name; one they do not accept is refused, not looked up.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+", re.IGNORECASE)
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")

class Blocked(Exception):
    """The request may not be sent; str(e) says why, naming the host/address and what the operator can do."""


@dataclass(frozen=True)
class Target:
    """Where a checked request goes: `url` connects to `address`; `host` is for the Host header and TLS SNI."""

    scheme: str
    host: str
    port: int
    address: str
    url: str


@dataclass(frozen=True)
class _Pattern:
    """One parsed --http-allow entry; `port` None means any port."""

    kind: Literal["any", "suffix", "exact", "localhost", "network"]
    port: int | None
    name: str = ""
    network: Network | None = None

    def port_matches(self, port: int) -> bool:
        return self.port is None or self.port == port

    def name_matches(self, host: str, is_literal: bool) -> bool:
        """Whether this name pattern matches the URL host (False for address patterns)."""
        if self.kind == "any":
            return True
        if is_literal:
            return False
        if self.kind == "suffix":
            return host.endswith("." + self.name)
        return self.kind in ("exact", "localhost") and host == self.name

    def contains(self, ip: Address) -> bool:
        """Whether this address pattern contains `ip` (IPv4 also tried as ::ffff:a.b.c.d against IPv6 nets)."""
        net = self.network
        if net is None:
            return False
        if ip.version == net.version:
            return ip in net
        return ip.version == 4 and ipaddress.IPv6Address(f"::ffff:{ip}") in net


def _parse_port(text: str, pattern: str) -> int | None:
    if text == "*":
        return None
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise ValueError(f"--http-allow {pattern!r}: bad port {text!r}; {_SYNTAX}")
    return int(text)


def _looks_numeric(host: str) -> bool:
    """Whether `host` ends in a numeric label, so that it can only be an IPv4 address."""
    return bool(_NUMERIC_LABEL.fullmatch(host.removesuffix(".").rpartition(".")[2]))


def _encode_name(name: str) -> str | None:
    """The lowercase IDNA (ASCII) form of a host name without its trailing dot, or None if it is not a valid name."""
    try:
        ascii_name = name.encode("idna").decode("ascii").lower() if not name.isascii() else name.lower()
    except UnicodeError:
        return None
    if ascii_name.endswith("."):
        ascii_name = ascii_name[:-1]
    labels = ascii_name.split(".")
    if not ascii_name or len(ascii_name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return None
    return ascii_name


def _parse_pattern(pattern: str) -> _Pattern:
    def bad(why: str) -> ValueError:
        return ValueError(f"--http-allow {pattern!r}: {why}; {_SYNTAX}")

    if not pattern or any(c.isspace() or not c.isprintable() for c in pattern):
        raise bad("empty or contains whitespace or control characters")
    if "://" in pattern or "@" in pattern or "?" in pattern or "#" in pattern:
        raise bad("give a host, not a URL")
    port: int | None = None
    if pattern.startswith("["):
        close = pattern.find("]")
        if close < 0:
            raise bad("unclosed [")
        host, rest = pattern[1:close], pattern[close + 1 :]
        if "%" in host:
            raise bad("no zone ids (%) in addresses")
        if rest:
            if not rest.startswith(":"):
                raise bad("unexpected text after ]")
            port = _parse_port(rest[1:], pattern)
        try:
            net = ipaddress.IPv6Network(host, strict=True)
        except ValueError as e:
            raise bad(f"bad IPv6 address or CIDR ({e})") from None
        if net.prefixlen == 128 and net.network_address.ipv4_mapped is not None:
            return _Pattern("network", port, network=ipaddress.IPv4Network(net.network_address.ipv4_mapped))
        return _Pattern("network", port, network=net)
    if pattern.count(":") > 1:
        raise bad("IPv6 addresses go in brackets, e.g. [fd00::1]:8080")
    host, colon, port_text = pattern.partition(":")
    if colon:
        port = _parse_port(port_text, pattern)
    if not host:
        raise bad("no host")
    if "/" in host:
        if not re.fullmatch(r"[0-9.]+/[0-9]+", host):
            raise bad("bad CIDR (a path, or a CIDR that is not dotted-quad/prefix)")
        try:
            return _Pattern("network", port, network=ipaddress.IPv4Network(host, strict=True))
        except ValueError as e:
            raise bad(f"bad CIDR ({e})") from None
    if _looks_numeric(host):
        try:
            return _Pattern("network", port, network=ipaddress.IPv4Network(host))
        except ValueError:
            raise bad("write IPv4 addresses in dotted-quad form, e.g. 10.0.0.5") from None
    if host == "*":
        return _Pattern("any", port)
    if host.startswith("*."):
        name = _encode_name(host[2:])
        if name is None:
            raise bad(f"bad domain after *. in {host!r}")
        return _Pattern("suffix", port, name=name)
    if "*" in host:
        raise bad("* may only be the whole host or a leading *. label")
    name = _encode_name(host)
    if name is None:
        raise bad(f"bad host name {host!r}")
    return _Pattern("localhost" if name == "localhost" else "exact", port, name=name)


def _default_resolver(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for (host, port), all families, stream sockets."""
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise Blocked(f"blocked: host {host} does not resolve ({e})") from None
    return [str(info[4][0]) for info in infos]


def _entry(host: str | Address, port: int) -> str:
    """An --http-allow entry naming `host` on `port`."""
    if isinstance(host, ipaddress.IPv6Address):
        return f"--http-allow [{host}]:{port}"
    return f"--http-allow {host}:{port}"


def _url_host(netloc: str) -> tuple[str, str]:
    """Split a netloc (no userinfo) into (host, port text); raises Blocked on anything malformed."""
    if netloc.startswith("["):
        close = netloc.find("]")
        if close < 0:
            raise Blocked(f"blocked: malformed host in {netloc!r}")
        host, rest = netloc[1:close], netloc[close + 1 :]
        if rest and not rest.startswith(":"):
            raise Blocked(f"blocked: malformed host in {netloc!r}")
        return host, rest[1:]
    if "[" in netloc or "]" in netloc or netloc.count(":") > 1:
        raise Blocked(f"blocked: malformed host in {netloc!r}")
    host, _, port = netloc.partition(":")
    return host, port


class HttpPolicy:
    """The operator's --http-allow list; `check(url)` decides a request and pins its address."""

    def __init__(self, patterns: Sequence[str] = (), resolver: Resolver | None = None) -> None:
        """Parse `patterns` (ValueError naming a malformed one); `resolver(host, port)` gives IP strings."""
        self.patterns: tuple[str, ...] = tuple(patterns)
        self._parsed = tuple(_parse_pattern(p) for p in self.patterns)
        self._resolve: Resolver = resolver or _default_resolver

    @property
    def allows_anything(self) -> bool:
        """False when there are no patterns, i.e. outbound HTTP is off."""
        return bool(self._parsed)

    def check(self, url: str) -> Target:
        """The Target to connect to for `url`; raises Blocked when it may not be fetched."""
        if any(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in url):
            raise Blocked("blocked: the URL contains whitespace or control characters")
        try:
            parts = urlsplit(url)
        except ValueError as e:
            raise Blocked(f"blocked: malformed URL ({e})") from None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS:
            raise Blocked(f"blocked: scheme {scheme or '(none)'!r} is not allowed; only http and https are")
        if "@" in parts.netloc:
            raise Blocked("blocked: URLs with user info (user:password@host) are not allowed")
        written, port_text = _url_host(parts.netloc)
        if not written:
            raise Blocked("blocked: the URL has no host")
        if port_text:
            if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
                raise Blocked(f"blocked: bad port {port_text!r}")
            port = int(port_text)
        else:
            port = _DEFAULT_PORTS[scheme]
        if not self._parsed:
            raise Blocked("outbound HTTP is off on this server: the operator allows hosts with "
                          "--http-allow HOST[:PORT]")

        host, literal = self._literal_host(parts.netloc, written)
        is_literal = literal is not None
        applicable = [p for p in self._parsed if p.port_matches(port)]
        named = [p for p in applicable if p.kind != "network" and p.name_matches(host, is_literal)]
        by_address = [p for p in applicable if p.kind == "network"]
        if not named and not by_address:
            suggest = _entry(literal if literal is not None else host, port)
            raise Blocked(f"blocked: host {host} (port {port}) is not in this server's --http-allow list; "
                          f"the operator can add {suggest}")

        if literal is not None:
            addresses = [literal]
        else:
            raw = self._resolve(host, port)
            try:
                addresses = list(dict.fromkeys(canonical(a) for a in raw))
            except ValueError as e:
                raise Blocked(f"blocked: host {host} resolved to a malformed address ({e})") from None
            if not addresses:
                raise Blocked(f"blocked: host {host} does not resolve to any address")
        for ip in addresses:
            self._check_address(ip, host, port, literal is not None, named, by_address)

        address = str(addresses[0])
        netloc = f"[{address}]" if addresses[0].version == 6 else address
        if port_text:
            netloc += f":{port}"
        target_url = f"{scheme}://{netloc}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")
        return Target(scheme=scheme, host=host, port=port, address=address, url=target_url)

    @staticmethod
    def _literal_host(netloc: str, written: str) -> tuple[str, Address | None]:
        """The URL host in canonical written form, and its address when it is an IP literal."""
        if netloc.startswith("["):
            bare = written.split("%", 1)[0]
            try:
                ip = ipaddress.IPv6Address(bare)
            except ValueError:
                raise Blocked(f"blocked: {written!r} in brackets is not an IPv6 address") from None
            mapped = ip.ipv4_mapped
            return bare.lower(), (mapped if mapped is not None else ip)
        lowered = written.lower()
        if _looks_numeric(lowered):
            # inet_aton is what getaddrinfo uses for these forms; parse here so no DNS query is ever made.
            try:
                return lowered, ipaddress.IPv4Address(socket.inet_aton(lowered))
            except OSError:
                raise Blocked(f"blocked: {written!r} is not a valid IPv4 address") from None
        name = _encode_name(written)
        if name is None:
            raise Blocked(f"blocked: {written!r} is not a valid host name")
        return name, None

    @staticmethod
    def _check_address(
        ip: Address, host: str, port: int, is_literal: bool, named: Iterable[_Pattern], by_address: Iterable[_Pattern]
    ) -> None:
        """Raise Blocked unless some applicable pattern allows connecting to `ip`."""
        if any(p.contains(ip) for p in by_address):
            return
        why = non_global(ip)
        kinds = {p.kind for p in named}
        if kinds - {"localhost"} and why is None:
            return
        if "localhost" in kinds and is_loopback(ip):
            return
        origin = "" if is_literal else f" (from {host})"
        if kinds - {"localhost"}:
            raise Blocked(f"blocked: {ip}{origin} is {why}; only an operator's --http-allow entry naming it by "
                          f"address (e.g. {_entry(ip, port)}) allows it")
        if kinds:
            raise Blocked(f"blocked: {ip}{origin} is not a loopback address; a localhost entry allows only "
                          f"127.0.0.0/8 and ::1 (the operator can add {_entry(ip, port)})")
        suggest = _entry(ip if is_literal or why is not None else host, port)
        raise Blocked(f"blocked: host {host}{'' if is_literal else f' ({ip})'} is not in this server's "
                      f"--http-allow list; the operator can add {suggest}")
