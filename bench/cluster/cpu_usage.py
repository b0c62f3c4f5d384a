"""CPU seconds by role over a window of a benchmark: where a small machine's cores went.

On a 2-core machine running four engines, two stores, an index and a router, every CPU second
a helper process burns is a second an engine does not get, so a configuration's TPOT moves with
what runs beside the engines, not only with what the connector does inside them. The meter
reads ``utime + stime`` of each role's processes and all their descendants from ``/proc`` at
the window's two ends (Linux only; elsewhere every figure is ``None``). A process that starts
or ends inside the window counts only what it used while both snapshots saw it, so the
figures are a floor; the engines and services of a benchmark live through its replay.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _process_table() -> dict[int, tuple[int, int]]:
    """Every process's (parent pid, utime + stime in clock ticks), from one read of each
    ``/proc/<pid>/stat`` (stat fields 4, 14 and 15)."""
    table: dict[int, tuple[int, int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


def process_tree(roots: Iterable[int], children: Mapping[int, list[int]]) -> set[int]:
    """``roots`` and every descendant of theirs (double-forked daemons are not descendants:
    give their pids as roots)."""
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


class CpuMeter:
    """``start()``, run the workload, ``stop()``: CPU seconds each role used in between.

    ``roles`` maps a role ("engines", "stores", ...) to its processes' pids; each counts with
    all its descendants, except the roles named in ``alone`` (the benchmark's own process,
    whose children are everything else). Not thread-safe; one window per meter."""

    def __init__(self, roles: Mapping[str, Iterable[int]], alone: Iterable[str] = ()) -> None:
        self.roles = {role: list(pids) for role, pids in roles.items()}
        self.alone = set(alone)
        self._before: dict[str, dict[int, int]] = {}
        self.available = PROC.joinpath("self", "stat").exists()

    def _snapshot(self) -> dict[str, dict[int, int]]:
        """CPU ticks of each live process of each role."""
        table = _process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        out: dict[str, dict[int, int]] = {}
        for role, pids in self.roles.items():
            members = pids if role in self.alone else process_tree(pids, children)
            out[role] = {pid: table[pid][1] for pid in members if pid in table}
        return out

    def start(self) -> None:
        if self.available:
            self._before = self._snapshot()

    def stop(self) -> dict[str, float | None]:
        """CPU seconds per role since ``start`` (``None`` where ``/proc`` cannot say)."""
        if not self.available:
            return dict.fromkeys(self.roles)
        after = self._snapshot()
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float | None] = {}
        for role, ticks in after.items():
            before = self._before.get(role, {})
            used = sum(t - before[pid] for pid, t in ticks.items() if pid in before)
            out[role] = used / tick
        return out
