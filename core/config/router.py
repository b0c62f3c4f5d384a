"""``[router]``: the front door (``kvtier router serve``), the Gateway API endpoint picker
(``kvtier router epp``) and the instances they route to."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvtier.core.config.section import Renamed, Section

POLICY_NAMES = ("round-robin", "least-load", "sticky", "cache-aware", "lmetric", "hybrid", "kvtier")


IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_LABEL = r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?"
_HOST_NAME = re.compile(rf"(\*\.)?({_LABEL}\.)*{_LABEL}")  # a name, or *.name


@dataclass(frozen=True)
class HostPattern:
    """One ``router.discover_allow`` entry: which announced API URLs the router may send
    prompts to. ``host`` is an IP network (a bare address is a /32 or /128), a host name
    (exact, or ``*.suffix`` for any name under it) or ``*`` (any host); ``port`` None = any.

    Written ``HOST``, ``HOST:PORT``, ``[IPv6]:PORT``, ``CIDR``, ``CIDR:PORT``. Names match the
    URL as written, never through DNS: what a name resolves to is decided later, by whoever
    runs DNS, so only list names whose resolution you trust."""

    text: str
    network: IpNetwork | None
    name: str | None  # lowercase; "*.x" matches any name ending in ".x"; "*" matches any host
    port: int | None

    @classmethod
    def parse(cls, text: str) -> HostPattern:
        raw = text.strip()
        if "://" in raw:
            raise ValueError(f"{text!r}: a host pattern (HOST, HOST:PORT, CIDR), not a URL")
        host, port = raw, None
        if raw.startswith("["):  # [v6] or [v6]:port (or [v6/len]:port)
            host, sep, rest = raw[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ValueError(f"{text!r}: write an IPv6 address as [ADDR] or [ADDR]:PORT")
            port = rest[1:] or None
        elif raw.count(":") == 1:  # host:port (a bare IPv6 address has several colons)
            host, port = raw.split(":")
        number: int | None = None
        if port is not None and port != "*":
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{text!r}: port {port!r} is not a number in 1..65535")
            number = int(port)
        if not host:
            raise ValueError(f"{text!r}: no host")
        try:
            return cls(raw, ipaddress.ip_network(host, strict=False), None, number)
        except ValueError:
            pass
        name = host.lower()
        if name != "*" and not _HOST_NAME.fullmatch(name):
            raise ValueError(
                f"{text!r}: not an IP address, a CIDR network, a host name or *.domain"
            )
        return cls(raw, None, name, number)

    def admits(self, host: str, port: int) -> bool:
        """``host`` as it stands in a URL (lowercase, no brackets), ``port`` resolved."""
        if self.port is not None and port != self.port:
            return False
        if self.name is not None:
            if self.name == "*":
                return True
            if self.name.startswith("*."):
                return host.endswith(self.name[1:])
            return host == self.name
        assert self.network is not None
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name: IP patterns never match it (no DNS lookups here)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        return address in self.network


# What an anonymous deployment (no credentials anywhere: `make run`) admits from the index.
LOOPBACK_PATTERNS = ("127.0.0.0/8", "::1", "localhost")


def url_host_port(url: str) -> tuple[str, int] | None:
    """(host, port) an API URL dials, or None when it is not an http(s) URL with a host."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname.lower(), port or (443 if parts.scheme == "https" else 80)


class BackendConfig(Section):
    """A vLLM instance's OpenAI API, listed by hand (instances announcing an ``api`` endpoint
    to the index are found without this)."""

    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000")
    name: str | None = Field(
        None, description="its location name in the index (to know what its GPU holds)"
    )
    node: str = Field("", description="the node it runs on (whose DRAM pool it reads)")


class RouterConfig(Section):
    """The front door (``kvtier router serve``) and the Gateway API endpoint picker."""

    SECTION: ClassVar[str] = "router"
    RENAMED: ClassVar[dict[str, Renamed]] = {"index_timeout_ms": Renamed("index_timeout_s", 1e-3)}

    host: str = Field(
        "127.0.0.1", description="address the router's OpenAI API (and health, metrics) binds"
    )
    port: int = Field(8100, ge=0, le=65535, description="HTTP port; 0 picks a free one")
    policy: str = Field("kvtier", description=f"one of {', '.join(POLICY_NAMES)}")
    backends: list[BackendConfig] = Field(
        default_factory=list, description="instances listed by hand (besides discovered ones)"
    )
    discover: bool = Field(
        True, description="also route to instances that announce an api endpoint to the index"
    )
    discover_allow: list[str] | None = Field(
        None,
        description="announced instances the router may route to, by their API URL: entries "
        "HOST, HOST:PORT, [IPv6]:PORT, CIDR (10.0.0.0/8), CIDR:PORT, *.domain, or * (any: "
        "only where every engine credential is trusted); others are refused (logged once, "
        "kvtier_router_discovery_refused_total). Unset: loopback when the router runs "
        "without any credential (anonymous loopback deployment, `make run`), none otherwise "
        "(any engine credential may announce any URL: docs/router.md)",
    )
    model: str | None = Field(
        None,
        description="directory (or hub id, if cached) of the served model's tokenizer; unset "
        "= ask each request's instance (/tokenize), slower",
    )
    session_header: str = Field("x-session-id", description="request header naming a session")
    route_by_last_turn: bool = Field(
        True,
        description="a chat turn that extends its session's last tokenized turn is routed by "
        "that turn's token ids and an estimated length, and tokenized after routing (off the "
        "request's path); false: tokenize every turn before routing",
    )
    engine_hints: bool = Field(
        True,
        description="tell the chosen instance, in the request's kv_transfer_params, the "
        "longest run of its prompt on another node as the index answered the decision: its "
        "connector then skips its own index query when no other node could extend its "
        "node's run (kvtier.core.engine_hint)",
    )
    refresh_s: float = Field(2.0, gt=0, description="re-read backends from the index this often")
    scrape_s: float = Field(1.0, gt=0, description="scrape each instance's /metrics this often")
    probe_s: float = Field(5.0, gt=0, description="active health probe (a 1-token completion)")
    probe_timeout_s: float = Field(10.0, gt=0, description="deadline of one health probe")
    max_scrapes_per_s: float = Field(
        100.0,
        gt=0,
        description="at most this many /metrics scrapes a second, whatever the fleet: past "
        "scrape_s x this many instances each is scraped less often (one costs the router ~1 ms "
        "of CPU; its own in-flight accounting covers the time between)",
    )
    max_probes_per_s: float = Field(
        50.0,
        gt=0,
        description="at most this many health probes a second, whatever the fleet: past "
        "probe_s x this many instances each is probed less often",
    )
    eject_s: float = Field(10.0, gt=0, description="an instance that failed stays out this long")
    connect_timeout_s: float = Field(
        2.0, gt=0, description="deadline of a new connection to an instance"
    )
    first_byte_timeout_s: float = Field(
        600.0, gt=0, description="no response headers by then: the instance is hung"
    )
    retries: int = Field(2, ge=0, le=2, description="before the first byte, each elsewhere")
    speculative_s: float = Field(
        3.0, ge=0, description="a routed prefix counts as on its instance's GPU this long"
    )
    # 4 MiB: a 128k-token prompt is ~0.95 MB as token ids, ~1 MB as English text, 0.8 MB as
    # \u-escaped CJK and 1.5 MB at worst (12 bytes a token: escaped astral characters), so
    # 4 MiB holds it with room for a chat's structure and tools. Parsing costs ~12 ms per MiB
    # of token ids with the GIL held (measured): 64 MiB stalled the event loop for seconds.
    max_body_bytes: int = Field(
        4 << 20,
        gt=0,
        description="largest request body accepted (413 beyond it, by Content-Length or while "
        "a chunked body streams in); 4 MiB holds a 128k-token prompt in any encoding. Raise "
        "it for longer contexts or images sent inline as data URLs",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="client connections open at once; beyond it a new one is answered 503 "
        "and closed before it is read. Each proxied request also holds a connection to its "
        "instance: keep it under half the process's file descriptor limit (ulimit -n)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a client connection must send a request's whole header within this "
        "(slowloris: half-sent requests holding connections); closed otherwise",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body must arrive within this once read (408)"
    )
    # 50 ms: a healthy loopback index answers a 128k-token query in 1 ms (p50; p99.9 3 ms,
    # max 6 ms, idle), but the answer then waits for this process's GIL behind the router's
    # own Python work, in 5 ms switch intervals: with router, index, instance and clients on
    # 2 cores, 5/10/25 ms deadlines missed 41/31/7 % of a healthy index's answers at 8
    # concurrent 32k-token requests (9/3/2 % one at a time), 50 ms none. A frozen index
    # costs only a few requests the deadline (index_gate.py), then nothing.
    index_timeout_s: float = Field(
        0.05,
        gt=0,
        description="deadline of the index query of one routing decision; past it the "
        "request is routed by load alone (kvtier_router_index_degraded_total, /readyz "
        "index: degraded). Raise it for an index across a slow network; lower it where a "
        "stalled index must cost even less (misses rise on a busy router: docs/router.md)",
    )
    index_replica: bool = Field(
        True,
        description="keep a copy of the index in the router's process, loaded from a snapshot "
        "and kept current from the index's change feed, and answer decisions from it (no "
        "round trip per request; docs/router.md, 'The index replica'); off: ask the index "
        "each decision",
    )
    name: str = Field(
        "",
        description="this router replica's name in what it shares with the others (default: "
        "host:pid); a random tag is added, and the index prefixes the caller's credential",
    )
    share_state: bool = Field(
        True,
        description="router replicas share, through the index's change feed, what each alone "
        "sees: requests in flight per instance, ejections, prompts just routed (docs/router.md, "
        "'Replicas that agree'); needs index_replica",
    )
    share_interval_s: float = Field(
        0.1, gt=0, description="how often this replica shares its view with the others"
    )
    share_ttl_s: float = Field(
        1.0,
        gt=0,
        le=10,
        description="a replica's share counts this long; a replica that stopped sharing (dead, "
        "partitioned) is forgotten after it",
    )
    index_replica_max_stale_s: float = Field(
        2.0,
        gt=0,
        description="the replica answers only while it heard from the feed this recently; "
        "past it decisions ask the index directly until the replica is current again",
    )
    max_in_flight: int = Field(
        256, ge=1, description="per instance; beyond it the instance counts as saturated"
    )
    offload: bool = Field(
        False,
        description="selective prefill offload: a heavy prefill runs on a less loaded instance "
        "(one token), the request then goes to its own instance, which loads the chunks "
        "(docs/router.md, 'Selective prefill offload'); needs the connector on every instance",
    )
    offload_min_tokens: int = Field(
        8192, ge=1, description="offload only prompts whose uncached tokens reach this"
    )
    offload_margin: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="offload only when the cost model makes it this much cheaper than "
        "prefilling at home (0.2: 20 %)",
    )
    offload_max_concurrent: int = Field(2, ge=1, description="offloaded prefills in flight")
    offload_timeout_s: float = Field(
        30.0, gt=0, description="a helper's prefill past this is abandoned (home computes)"
    )
    offload_settle_s: float = Field(
        0.5,
        ge=0,
        description="after the helper answered, wait up to this long for the index to show "
        "its chunks in its node's pool (saves commit a step after the prefill)",
    )
    decision_log: Path | None = Field(None, description="JSONL file of every decision")
    kappa_file: Path | None = Field(
        None, description="JSON kappa table from kvtier bench tier-latency (default: reference)"
    )
    dram_credit: float = Field(0.5, ge=0, le=1, description="cache-aware/lmetric/hybrid credit")
    # kvtier router epp: the Gateway API Inference Extension's endpoint picker (Envoy ext_proc)
    epp_host: str = Field("127.0.0.1", description="endpoint picker: gRPC (ext_proc) host")
    epp_port: int = Field(9002, ge=0, le=65535, description="endpoint picker: gRPC port")
    epp_health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="endpoint picker: also serve gRPC health, plaintext, on this port (for "
        "Kubernetes gRPC probes when the ext_proc port uses TLS); unset = the main port only",
    )
    epp_body_mode: Literal["full-duplex", "buffered"] = Field(
        "full-duplex",
        description="endpoint picker: the gateway's ext_proc request_body_mode when its "
        "messages do not say (protocol_config): FULL_DUPLEX_STREAMED, as the extension's "
        "gateways configure, or BUFFERED",
    )
    epp_fallbacks: int = Field(
        0,
        ge=0,
        le=8,
        description="endpoint picker: endpoints named after the chosen one, best first, for "
        "the gateway's retries",
    )

    @field_validator("discover_allow")
    @classmethod
    def _patterns(cls, value: list[str] | None) -> list[str] | None:
        for i, text in enumerate(value or ()):
            try:
                HostPattern.parse(text)
            except ValueError as exc:
                raise ValueError(f"router.discover_allow[{i}] {exc}") from None
        return value

    def allow_patterns(self) -> tuple[HostPattern, ...] | None:
        """``discover_allow`` parsed (None when unset)."""
        if self.discover_allow is None:
            return None
        return tuple(HostPattern.parse(text) for text in self.discover_allow)

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"router.policy {self.policy!r}: one of {', '.join(POLICY_NAMES)}")
        return self
