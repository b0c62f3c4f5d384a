"""``[router]``: the front door (``kvtier router serve``), the Gateway API endpoint picker
(``kvtier router epp``) and the instances they route to."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kvtier.config_section import Section

POLICY_NAMES = ("round-robin", "least-load", "sticky", "cache-aware", "lmetric", "hybrid", "kvtier")


class BackendConfig(Section):
    """A vLLM instance's OpenAI API, listed by hand (instances announcing an ``api`` endpoint
    to the index are found without this)."""

    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000")
    name: str | None = Field(
        None, description="its location name in the index (to know what its GPU holds)"
    )
    node: str = Field("", description="the node it runs on (whose DRAM pool it reads)")


class RouterConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    policy: str = Field("kvtier", description=f"one of {', '.join(POLICY_NAMES)}")
    backends: list[BackendConfig] = Field(default_factory=list)
    discover: bool = Field(
        True, description="also route to instances that announce an api endpoint to the index"
    )
    model: str | None = Field(
        None,
        description="directory (or hub id, if cached) of the served model's tokenizer; unset "
        "= ask each request's instance (/tokenize), slower",
    )
    session_header: str = Field("x-session-id", description="request header naming a session")
    refresh_s: float = Field(2.0, gt=0, description="re-read backends from the index this often")
    scrape_s: float = Field(1.0, gt=0, description="scrape each instance's /metrics this often")
    probe_s: float = Field(5.0, gt=0, description="active health probe (a 1-token completion)")
    probe_timeout_s: float = Field(10.0, gt=0)
    eject_s: float = Field(10.0, gt=0, description="an instance that failed stays out this long")
    connect_timeout_s: float = Field(2.0, gt=0)
    first_byte_timeout_s: float = Field(
        600.0, gt=0, description="no response headers by then: the instance is hung"
    )
    retries: int = Field(2, ge=0, le=2, description="before the first byte, each elsewhere")
    speculative_s: float = Field(
        3.0, ge=0, description="a routed prefix counts as on its instance's GPU this long"
    )
    max_body_bytes: int = Field(64 << 20, gt=0, description="largest request body accepted")
    max_in_flight: int = Field(
        256, ge=1, description="per instance; beyond it the instance counts as saturated"
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

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"router.policy {self.policy!r}: one of {', '.join(POLICY_NAMES)}")
        return self
