"""``router.discover_allow``: which announced instance URLs a pattern admits (an address, a
network, a port, a host name with a wildcard; a name is never an IP), and entries that are
configuration errors (the router refusing an engine's own server, over real processes:
tests/integration/security/test_router_trust.py)."""

from __future__ import annotations

import pytest

from kvtier.core.config.router import RouterConfig


@pytest.mark.parametrize(
    ("pattern", "url", "admitted"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000", True),
        ("127.0.0.1:8000", "http://127.0.0.1:8001", False),
        ("10.0.0.0/8", "http://10.1.2.3:8000/", True),
        ("10.0.0.0/8:8000", "https://10.1.2.3:9000", False),
        ("10.0.0.0/8", "http://10.0.0.1.evil.example:8000", False),  # a name is not an IP
        ("[::1]:8000", "http://[::1]:8000", True),
        ("127.0.0.1", "http://[::ffff:127.0.0.1]:80", True),
        ("*.vllm.svc", "http://pod-1.vllm.svc:8000", True),
        ("*.vllm.svc", "http://vllm.svc.evil:8000", False),
        ("vllm-0", "http://user@vllm-0:8000", True),
        ("vllm-0", "ftp://vllm-0", False),
        ("*", "http://anything:1", True),
    ],
)
def test_discover_allow_patterns(pattern: str, url: str, admitted: bool) -> None:
    from kvtier.core.config.router import HostPattern
    from kvtier.router.discovery import DiscoveryPolicy

    policy = DiscoveryPolicy([HostPattern.parse(pattern)], "test")
    assert policy.admits(url) is admitted


@pytest.mark.parametrize("bad", ["http://10.0.0.1", "10.0.0.1:http", "a b", "[::1", ""])
def test_bad_discover_allow_entries_are_config_errors(bad: str) -> None:
    with pytest.raises(ValueError, match=r"router.discover_allow\[1\]"):
        RouterConfig(discover_allow=["10.0.0.0/8", bad])
