"""The knee sweep's results: one ``ConfigResult`` per configuration, the ``KneeReport`` that
gathers them by DRAM setting (saved as ``knee.json``, read back by ``kvtier bench knee
--report``), and the knee found in each line.

Knee, per DRAM setting: the smallest GPU capacity whose hit ratio reaches ``fraction`` (0.9)
of the best of that line; the reference says it sits at S*W.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def dram_label(dram_bytes: int | None) -> str:
    return "none" if dram_bytes is None else f"{dram_bytes / 2**20:.1f} MiB"


@dataclass
class ConfigResult:
    gpu_blocks: int
    gpu_tokens: int
    gpu_multiple: float  # of S*W
    dram_bytes: int | None
    dram_multiple: float | None
    requests: int
    errors: int
    queried_tokens: float  # prefix-cache queries delta: prompt tokens of new requests
    client_prompt_tokens: int  # the same, counted by the client (a check)
    cached_tokens: dict[str, float]  # by source
    hit: dict[str, float]  # device / host / p2p / total, of queried tokens
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_by_turn_p50_s: dict[str, float | None]
    preemptions: float
    kvtier: dict[str, float]  # vllm:kvtier_* deltas (DRAM configurations)
    load_avg: tuple[float, float, float]  # the machine's, when the workload started
    wall_s: float
    results: str  # per-request JSONL
    log: str  # the vLLM server's log

    @property
    def dram_label(self) -> str:
        return dram_label(self.dram_bytes)


@dataclass
class KneeReport:
    machine: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    fraction: float
    results: list[ConfigResult] = field(default_factory=list)

    def lines(self) -> dict[int | None, list[ConfigResult]]:
        """Results by DRAM setting (no DRAM first), each by GPU capacity."""
        out: dict[int | None, list[ConfigResult]] = {}
        for r in sorted(self.results, key=lambda r: (r.dram_bytes is not None, r.dram_bytes or 0)):
            out.setdefault(r.dram_bytes, []).append(r)
        return {k: sorted(v, key=lambda r: r.gpu_blocks) for k, v in out.items()}

    def knees(self) -> list[dict[str, Any]]:
        out = []
        sw = self.workload["total_working_set_tokens"]
        for dram, line in self.lines().items():
            tiers = ("total",) if dram is None else ("total", "device")
            for tier in tiers:
                knee = find_knee([(r.gpu_blocks, r.hit[tier]) for r in line], self.fraction)
                if knee is None:
                    continue
                blocks, best = knee
                tokens = blocks * self.workload["block_tokens"]
                out.append(
                    {
                        "dram_bytes": dram,
                        "dram": dram_label(dram),
                        "tier": tier,
                        "gpu_blocks": blocks,
                        "gpu_tokens": tokens,
                        "gpu_multiple": tokens / sw,
                        "best_hit": best,
                        "threshold": self.fraction * best,
                        "at_or_below_smallest": blocks == line[0].gpu_blocks,
                    }
                )
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KneeReport:
        """A report saved by ``to_json`` (to print or plot it again)."""
        results = [
            ConfigResult(**{k: v for k, v in c.items() if k != "dram"}) for c in data["configs"]
        ]
        return cls(data["machine"], data["model"], data["workload"], data["fraction"], results)

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "model": self.model,
            "workload": self.workload,
            "fraction": self.fraction,
            "configs": [asdict(r) | {"dram": r.dram_label} for r in self.results],
            "knees": self.knees(),
        }


def find_knee(points: Sequence[tuple[int, float]], fraction: float) -> tuple[int, float] | None:
    """(capacity, best hit ratio): the smallest capacity reaching ``fraction`` of the best.

    None when nothing hits at all (no knee to speak of).
    """
    if not points:
        return None
    best = max(h for _, h in points)
    if best <= 0:
        return None
    return min(c for c, h in points if h >= fraction * best), best
