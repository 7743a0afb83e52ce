"""host/net/policy.py: the --http-allow patterns and the SSRF rules of HttpPolicy.check (no network)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence

import pytest

from host.net.policy import Blocked, HttpPolicy, Target, _Pattern

PUBLIC4 = "93.184.216.34"
PUBLIC6 = "2606:2800:220:1:248:1893:25c8:1946"


def resolver(table: Mapping[str, Sequence[str]], calls: list[tuple[str, int]] | None = None
             ) -> Callable[[str, int], list[str]]:
    """A resolver answering from `table`, recording its calls; unknown names do not resolve."""
    def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append((host, port))
        if host not in table:
            raise Blocked(f"blocked: host {host} does not resolve")
        return list(table[host])
    return resolve


def no_resolver(host: str, port: int) -> list[str]:
    raise AssertionError(f"the resolver must not be called (asked for {host}:{port})")


def policy(patterns: Sequence[str], table: Mapping[str, Sequence[str]] | None = None) -> HttpPolicy:
    return HttpPolicy(patterns, resolver(table) if table is not None else no_resolver)


# --- off, names, ports


def test_no_patterns_blocks_everything() -> None:
    off = HttpPolicy((), resolver({"example.com": [PUBLIC4]}))
    assert not off.allows_anything and off.patterns == ()
    with pytest.raises(Blocked, match="outbound HTTP is off on this server.*--http-allow HOST"):
        off.check("http://example.com/")
    on = HttpPolicy(["Example.com:443", "*"])
    assert on.allows_anything and on.patterns == ("Example.com:443", "*")


def test_exact_name_allows_public_address() -> None:
    p = policy(["example.com"], {"example.com": [PUBLIC4]})
    assert p.check("https://Example.COM./a/b?x=1&y=2#frag") == Target(
        scheme="https", host="example.com", port=443, address=PUBLIC4, url=f"https://{PUBLIC4}/a/b?x=1&y=2")
    with pytest.raises(Blocked, match=r"host evil\.com \(port 80\) is not in this server's --http-allow list; "
                                      r"the operator can add --http-allow evil\.com:80"):
        p.check("http://evil.com/")


def test_unmatched_host_is_not_resolved() -> None:
    calls: list[tuple[str, int]] = []
    p = HttpPolicy(["example.com"], resolver({"evil.com": [PUBLIC4]}, calls))
    with pytest.raises(Blocked, match="not in this server's --http-allow list"):
        p.check("http://evil.com/")
    assert calls == []


def test_port_must_match() -> None:
    p = policy(["example.com:443"], {"example.com": [PUBLIC4]})
    assert p.check("https://example.com/").port == 443
    assert p.check("http://example.com:443/").url == f"http://{PUBLIC4}:443/"
    with pytest.raises(Blocked, match="port 80"):
        p.check("http://example.com/")
    with pytest.raises(Blocked, match="port 8443"):
        p.check("https://example.com:8443/")
    assert policy(["example.com:*"], {"example.com": [PUBLIC4]}).check("http://example.com:8443/").port == 8443


def test_wildcard_subdomains() -> None:
    table = {name: [PUBLIC4] for name in ["a.example.com", "b.a.example.com", "example.com", "badexample.com",
                                          "a.example.com.evil.com"]}
    p = policy(["*.example.com"], table)
    assert p.check("http://a.example.com/").host == "a.example.com"
    assert p.check("http://B.A.Example.com./").host == "b.a.example.com"
    for url in ["http://example.com/", "http://badexample.com/", "http://a.example.com.evil.com/"]:
        with pytest.raises(Blocked, match="not in this server's --http-allow list"):
            p.check(url)


def test_idna_names() -> None:
    calls: list[tuple[str, int]] = []
    p = HttpPolicy(["bücher.example"], resolver({"xn--bcher-kva.example": [PUBLIC4]}, calls))
    target = p.check("http://BÜCHER.example/")
    assert target.host == "xn--bcher-kva.example" and target.address == PUBLIC4
    assert calls == [("xn--bcher-kva.example", 80)]


def test_messages_do_not_leak_the_allowlist() -> None:
    p = policy(["secret-internal.corp", "*.example.com"], {"evil.com": ["10.0.0.1"]})
    with pytest.raises(Blocked) as e:
        p.check("http://evil.com/")
    assert "secret" not in str(e.value) and "example" not in str(e.value)


# --- the address rules

NON_GLOBAL = [
    ("127.0.0.1", "127.0.0.1", "a loopback address"),
    ("127.8.9.10", "127.8.9.10", "a loopback address"),
    ("10.1.2.3", "10.1.2.3", "a private address"),
    ("172.16.0.1", "172.16.0.1", "a private address"),
    ("192.168.1.1", "192.168.1.1", "a private address"),
    ("169.254.169.254", "169.254.169.254", "the cloud metadata address"),
    ("169.254.1.1", "169.254.1.1", "a link-local address"),
    ("0.0.0.0", "0.0.0.0", "an unspecified"),
    ("100.64.0.1", "100.64.0.1", "a shared"),
    ("198.18.0.1", "198.18.0.1", "a benchmarking address"),
    ("192.0.2.1", "192.0.2.1", "a documentation address"),
    ("203.0.113.9", "203.0.113.9", "a documentation address"),
    ("224.0.0.1", "224.0.0.1", "a multicast address"),
    ("240.0.0.1", "240.0.0.1", "a reserved address"),
    ("255.255.255.255", "255.255.255.255", "a reserved address"),
    ("::1", "::1", "a loopback address"),
    ("::", "::", "an unspecified address"),
    ("::ffff:127.0.0.1", "127.0.0.1", "a loopback address"),
    ("::ffff:a9fe:a9fe", "169.254.169.254", "the cloud metadata address"),
    ("::7f00:1", "::7f00:1", "IPv4-compatible"),
    ("fd00:ec2::254", "fd00:ec2::254", "the cloud metadata address"),
    ("fc00::1", "fc00::1", "a private"),
    ("fe80::1%eth0", "fe80::1", "a link-local address"),
    ("fec0::1", "fec0::1", "a site-local address"),
    ("ff02::1", "ff02::1", "a multicast address"),
    ("2001:db8::1", "2001:db8::1", "a documentation address"),
    ("2002:7f00:1::", "2002:7f00:1::", "a 6to4 form of 127.0.0.1, a loopback address"),
    ("2002:a00:1::1", "2002:a00:1::1", "a 6to4 form of 10.0.0.1, a private address"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "a Teredo form of 192.0.2.45"),
    ("64:ff9b::a00:1", "64:ff9b::a00:1", "a NAT64 form of 10.0.0.1, a private address"),
    ("64:ff9b:1::1", "64:ff9b:1::1", "a local-use NAT64 address"),
    ("::ffff:0:7f00:1", "::ffff:0:7f00:1", "a reserved address"),  # is_global is True here on Python 3.11
]


@pytest.mark.parametrize("pattern", ["*", "internal.example.com", "*.example.com"])
@pytest.mark.parametrize(("resolved", "shown", "kind"), NON_GLOBAL)
def test_name_patterns_allow_only_global_addresses(pattern: str, resolved: str, shown: str, kind: str) -> None:
    p = policy([pattern], {"internal.example.com": [resolved]})
    with pytest.raises(Blocked) as e:
        p.check("http://internal.example.com/")
    msg = str(e.value)
    assert msg.startswith(f"blocked: {shown} (from internal.example.com) is ") and kind in msg, msg
    entry = f"[{shown}]:80" if ":" in shown else f"{shown}:80"
    assert f"naming it by address (e.g. --http-allow {entry})" in msg, msg


@pytest.mark.parametrize("resolved", ["8.8.8.8", PUBLIC6, "2002:808:808::1", "64:ff9b::808:808"])
def test_name_patterns_allow_global_addresses(resolved: str) -> None:
    p = policy(["*"], {"example.com": [resolved]})
    assert p.check("http://example.com/").address == resolved


@pytest.mark.parametrize("order", [[PUBLIC4, "10.0.0.1"], ["10.0.0.1", PUBLIC4], [PUBLIC6, PUBLIC4, "::1"]])
def test_every_resolved_address_must_be_allowed(order: list[str]) -> None:
    p = policy(["example.com"], {"example.com": order})
    with pytest.raises(Blocked, match=r"(10\.0\.0\.1|::1) \(from example\.com\) is a (private|loopback) address"):
        p.check("http://example.com/")


def test_target_is_the_first_resolved_address() -> None:
    p = policy(["example.com"], {"example.com": [PUBLIC6, PUBLIC4, PUBLIC6]})
    assert p.check("http://example.com/").address == PUBLIC6
    p = policy(["example.com"], {"example.com": [PUBLIC4, PUBLIC6]})
    assert p.check("http://example.com/").address == PUBLIC4


def test_resolver_answers_are_checked() -> None:
    with pytest.raises(Blocked, match="does not resolve to any address"):
        policy(["*"], {"example.com": []}).check("http://example.com/")
    with pytest.raises(Blocked, match="malformed address"):
        policy(["*"], {"example.com": ["not-an-ip"]}).check("http://example.com/")
    with pytest.raises(Blocked, match="nowhere.example does not resolve"):
        policy(["*"], {}).check("http://nowhere.example/")


NUMERIC_LOOPBACK = ["2130706433", "0x7f.1", "127.1", "0177.0.0.1", "0x7f000001", "0x7F.0.0.1", "127.0.0.1"]


@pytest.mark.parametrize("form", NUMERIC_LOOPBACK)
def test_numeric_ipv4_forms_are_read_as_addresses(form: str) -> None:
    # getaddrinfo reads these spellings as 127.0.0.1 (numeric only: no DNS); the policy must agree.
    infos = socket.getaddrinfo(form, 80, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    assert {info[4][0] for info in infos} == {"127.0.0.1"}
    with pytest.raises(Blocked, match=r"^blocked: 127\.0\.0\.1 is a loopback address"):
        policy(["*"]).check(f"http://{form}/")


@pytest.mark.parametrize("url", ["http://[::1]/", "http://[::ffff:7f00:1]/", "http://[::ffff:127.0.0.1]:8080/",
                                 "http://0.0.0.0/", "http://0/", "http://[::]/", "http://[fe80::1%25eth0]/",
                                 "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/",
                                 "http://10.0.0.1/", "http://[2002:7f00:1::]/"])
def test_ip_literal_urls_need_global_addresses_under_star(url: str) -> None:
    with pytest.raises(Blocked, match=r"is (a|an|the) .*address"):
        policy(["*"]).check(url)


def test_ip_literal_urls_match_only_star_among_name_patterns() -> None:
    assert policy(["*"]).check("http://1.1.1.1/x").url == "http://1.1.1.1/x"
    assert policy(["*"]).check("http://[2606:4700::1111]/").address == "2606:4700::1111"
    for pattern in ["one.one.one.one", "*.example.com", "localhost"]:
        with pytest.raises(Blocked, match="not in this server's --http-allow list"):
            policy([pattern]).check("http://1.1.1.1/")


def test_name_patterns_never_match_literals() -> None:
    # Defense in depth: pattern parsing already refuses names that could spell an address.
    suffix = _Pattern("suffix", None, name="0.1")
    assert suffix.name_matches("a.0.1", False) and not suffix.name_matches("127.0.0.1", True)
    assert not _Pattern("exact", None, name="127.1").name_matches("127.1", True)
    assert _Pattern("any", None).name_matches("127.1", True)


def test_invalid_numeric_host_is_blocked_without_resolving() -> None:
    for host in ["999.1.1.1", "1.2.3.4.5", "127.0.0.1.", "0x1ffffffff", "foo.123", "a.0x1"]:
        with pytest.raises(Blocked, match="not a valid IPv4 address"):
            policy(["*"]).check(f"http://{host}/")


# --- address patterns and localhost


def test_ip_pattern_allows_that_address_and_port_only() -> None:
    p = policy(["127.0.0.1:8080"], {"myhost": ["127.0.0.1"], "other": ["127.0.0.2"]})
    assert p.check("http://127.0.0.1:8080/x") == Target("http", "127.0.0.1", 8080, "127.0.0.1",
                                                        "http://127.0.0.1:8080/x")
    assert p.check("http://2130706433:8080/") == Target("http", "2130706433", 8080, "127.0.0.1",
                                                        "http://127.0.0.1:8080/")
    assert p.check("http://[::ffff:127.0.0.1]:8080/").address == "127.0.0.1"
    assert p.check("http://myhost:8080/").address == "127.0.0.1"
    with pytest.raises(Blocked, match=r"host 127\.0\.0\.1 \(port 8081\) .* add --http-allow 127\.0\.0\.1:8081"):
        p.check("http://127.0.0.1:8081/x")
    with pytest.raises(Blocked, match=r"host other \(127\.0\.0\.2\) is not in .* add --http-allow 127\.0\.0\.2:8080"):
        p.check("http://other:8080/")


def test_localhost_pattern_allows_loopback_only() -> None:
    p = policy(["localhost:8080"], {"localhost": ["127.0.0.1", "::1"], "other": ["127.0.0.1"]})
    assert p.check("http://LocalHost:8080/v1?a=b") == Target("http", "localhost", 8080, "127.0.0.1",
                                                             "http://127.0.0.1:8080/v1?a=b")
    with pytest.raises(Blocked, match="port 80"):
        p.check("http://localhost/")
    with pytest.raises(Blocked, match="not in this server's --http-allow list"):
        p.check("http://127.0.0.1:8080/")  # a literal: only `*` among name patterns matches it
    with pytest.raises(Blocked, match="not in this server's --http-allow list"):
        p.check("http://other:8080/")
    for bad in (["10.0.0.1"], ["127.0.0.1", "10.0.0.1"], ["8.8.8.8"], ["2002:7f00:1::"]):
        with pytest.raises(Blocked, match=r"\(from localhost\) is not a loopback address"):
            policy(["localhost:8080"], {"localhost": bad}).check("http://localhost:8080/")
    assert policy(["localhost"], {"localhost": ["::1"]}).check("http://localhost/").url == "http://[::1]/"


def test_cidr_patterns() -> None:
    p = policy(["10.0.0.0/8"], {"internal.example.com": ["10.1.2.3"], "mixed.example.com": ["10.1.2.3", "11.0.0.1"]})
    assert p.check("http://internal.example.com/").address == "10.1.2.3"
    assert p.check("https://10.1.2.3:9000/").url == "https://10.1.2.3:9000/"
    assert p.check("http://012.1.2.3/").address == "10.1.2.3"
    with pytest.raises(Blocked, match=r"host 11\.0\.0\.1 .*not in this server's --http-allow list"):
        p.check("http://11.0.0.1/")
    with pytest.raises(Blocked, match=r"11\.0\.0\.1"):
        p.check("http://mixed.example.com/")
    p6 = policy(["[fd00::/8]:9000"])
    assert p6.check("http://[FD12::1]:9000/p?q=1#f") == Target("http", "fd12::1", 9000, "fd12::1",
                                                              "http://[fd12::1]:9000/p?q=1")
    with pytest.raises(Blocked, match=r"--http-allow \[fe80::1\]:9000"):
        p6.check("http://[fe80::1]:9000/")


def test_address_pattern_allows_non_global_kinds_named_explicitly() -> None:
    p = policy(["169.254.169.254", "[::1]", "[fd00:ec2::254]"], {"meta": ["169.254.169.254", "fd00:ec2::254"]})
    assert p.check("http://meta/").address == "169.254.169.254"
    assert p.check("http://[::1]:1234/").url == "http://[::1]:1234/"


def test_address_and_name_patterns_combine_per_address() -> None:
    p = policy(["example.com", "10.0.0.0/8"], {"example.com": [PUBLIC4, "10.0.0.7"]})
    assert p.check("http://example.com/").address == PUBLIC4


# --- URL form


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "gopher://example.com/",
                                 "ws://example.com/", "example.com/x", "//example.com/"])
def test_only_http_and_https(url: str) -> None:
    with pytest.raises(Blocked, match="scheme .* is not allowed; only http and https"):
        policy(["*"], {"example.com": [PUBLIC4]}).check(url)


@pytest.mark.parametrize("url", ["http://user:pass@example.com/", "http://user@example.com/",
                                 "http://@example.com/", "http://evil.com@example.com/",
                                 "http://evil.com\\@example.com/"])
def test_userinfo_is_blocked(url: str) -> None:
    with pytest.raises(Blocked, match="user info"):
        policy(["*"], {"example.com": [PUBLIC4], "evil.com": [PUBLIC4]}).check(url)


@pytest.mark.parametrize("url", ["http://exam\tple.com/", "http://example.com/\n", "http://exa\rmple.com/",
                                 "http://example.com /", "http://ex\x00ample.com/", "http://example.com/\x7f",
                                 "http://exam\u200bple.com/", "http://example.com/\u00a0"])
def test_whitespace_and_control_characters_are_blocked(url: str) -> None:
    with pytest.raises(Blocked, match="whitespace or control"):
        policy(["example.com"], {"example.com": [PUBLIC4]}).check(url)


@pytest.mark.parametrize(("url", "why"), [
    ("http:///path", "no host"), ("http://:80/", "no host"), ("http://", "no host"),
    ("http://[::1]x/", "malformed host"), ("http://[::1/", "malformed"), ("http://a:1:2/", "malformed host"),
    ("http://[example.com]/", "malformed"),
    ("http://exa%6dple.com/", "not a valid host name"), ("http://good.com\\.evil.com/", "not a valid host name"),
    ("http://a..com/", "not a valid host name"), ("http://example.com:0/", "bad port"),
    ("http://example.com:70000/", "bad port"), ("http://example.com:+80/", "bad port"),
    ("http://example.com:8o/", "bad port"),
])
def test_malformed_urls_are_blocked(url: str, why: str) -> None:
    with pytest.raises(Blocked, match=why):
        policy(["*"], {"example.com": [PUBLIC4]}).check(url)


def test_target_url_rewriting() -> None:
    p = policy(["*"], {"v4.example": [PUBLIC4], "v6.example": [PUBLIC6]})
    assert p.check("http://v4.example:8080/a%20b/c?q=1&r=%2F#top") == Target(
        "http", "v4.example", 8080, PUBLIC4, f"http://{PUBLIC4}:8080/a%20b/c?q=1&r=%2F")
    assert p.check("https://v6.example/x/y?z") == Target(
        "https", "v6.example", 443, PUBLIC6, f"https://[{PUBLIC6}]/x/y?z")
    assert p.check("http://v6.example:81").url == f"http://[{PUBLIC6}]:81/"
    assert p.check("http://v4.example:80/").url == f"http://{PUBLIC4}:80/"


# --- patterns


@pytest.mark.parametrize("pattern", [
    "", " ", "example.com ", " example.com", "exa mple.com", "example.com\n", "http://example.com",
    "example.com/path", "user@example.com", "example.com?x", "example.com:0", "example.com:70000", "example.com:",
    "example.com:http", "example.com:+80", "*:0", "10.0.0.0/33", "10.0.0.1/8", "10.0.0/8", "10.0.0.0/x",
    "[fd00::1", "fd00::1", "fd00::1:80", "[fd00::/129]", "[fd00::1/8]", "[10.0.0.1]", "[fd00::1]x", "[fd00::1]:",
    "[fe80::1%eth0]", "a.*.com", "*foo.com", "**", "*.", "*.*.com", "2130706433", "127.1", "0x7f.0.0.1",
    "10.0.0.5.", "foo.123", "example.0x1", "-bad.com", "bad-.com", "a..com", ".com", ":80", "ex!ample.com",
    "a" * 64 + ".com",
])
def test_bad_patterns_raise(pattern: str) -> None:
    with pytest.raises(ValueError, match=r"--http-allow .*expected HOST\[:PORT\]") as e:
        HttpPolicy([pattern])
    assert repr(pattern) in str(e.value)


def test_good_patterns_parse() -> None:
    good = ["*", "*:443", "*:*", "*.example.com", "*.example.com:8080", "Example.COM.", "example.com:1",
            "example.com:65535", "localhost", "LOCALHOST:8080", "10.0.0.5", "10.0.0.5:8080", "[fd00::1]",
            "[fd00::1]:8080", "10.0.0.0/8", "10.0.0.0/8:*", "[fd00::/8]", "[fd00::/8]:443", "[::ffff:10.0.0.5]",
            "bücher.example", "_srv.example.com", "xn--bcher-kva.example"]
    assert HttpPolicy(good).patterns == tuple(good)


def test_mapped_ipv6_pattern_is_the_ipv4_address() -> None:
    assert policy(["[::ffff:10.0.0.5]"]).check("http://10.0.0.5/").address == "10.0.0.5"
    assert policy(["[::ffff:0:0/96]"]).check("http://10.0.0.5/").address == "10.0.0.5"


# --- default resolver


def test_default_resolver_uses_getaddrinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []

    def fake_getaddrinfo(*args: object) -> list[tuple[object, ...]]:
        calls.append(args)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fe80::1%eth0", 80, 0, 2)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", (PUBLIC4, 80))]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    with pytest.raises(Blocked, match=r"fe80::1 \(from example\.com\) is a link-local address"):
        HttpPolicy(["example.com"]).check("http://example.com/")
    assert calls == [("example.com", 80, 0, socket.SOCK_STREAM)]


def test_default_resolver_failure_is_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> list[tuple[object, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(Blocked, match="host nowhere.example does not resolve"):
        HttpPolicy(["*"]).check("https://nowhere.example/")
