"""One dependency direction (docs/design.md, "Layers"), checked on every import statement of the
product, module-level or inside functions:

    composition roots (kvtier.cli, kvtier.__main__), bench      anything below
    connector                                                     tiers, service APIs, core
    router                                                        the index's api/client, core
    tiers                                                         service APIs and clients, core
    store / index servers                                         their own package, the other
                                                                  service's api/client, core
    store / index api + client                                    their own api/client, core
    core (keys, errors, chunks, config, rpc, http)                core

(The vLLM process importing no server machinery, in a fresh interpreter:
tests/integration/test_vllm_process_imports.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.layout import import_name, product_files

ROOTS = {"kvtier.cli", "kvtier.__main__", "kvtier.setup"}
CORE = "core"

# Imports that break the rule on purpose, each with its reason.
EXCEPTIONS = {
    # embedded mode: the store / index run in the caller's process behind the same interface
    ("kvtier.store.client", "kvtier.store.node"),
    ("kvtier.index.client", "kvtier.index.server.service"),
    # a router's replica of the index is the in-memory backend itself, fed by the change feed:
    # the same answers as the index by construction (index/client/replica.py)
    ("kvtier.index.client.replica", "kvtier.index.backends.memory"),
}


def modules() -> dict[str, Path]:
    """Every product module by its import name: the repository root is ``kvtier``, so a file's
    path is its name (``store/state/core.py`` is ``kvtier.store.state.core``)."""
    return {import_name(p): p for p in product_files() if "_pb2" not in p.name}


def layer(module: str) -> str:
    if module in ROOTS:
        return "root"
    if module == "kvtier" or module == "kvtier.core" or module.startswith("kvtier.core."):
        return CORE
    for service in ("store", "index"):
        prefix = f"kvtier.{service}"
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) + 1 :].split(".")[0]
            return f"{service}.api" if rest in ("api", "client", "proto") else f"{service}.server"
    top = module.split(".")[1]
    assert top in ALLOWED, f"{module}: give the new top-level package a layer here"
    return top


ALLOWED = {
    "root": None,  # anything
    "bench": None,
    "demo": None,  # a composition root: a cluster of real processes
    "testing": None,  # launches anything; nothing in the serving path imports it
    "traces": {"traces", "router", "store.server", CORE},  # the simulator reuses the policies
    "connector": {"connector", "tiers", "store.api", "index.api", CORE},
    "router": {"router", "index.api", CORE},
    "tiers": {"tiers", "store.api", "index.api", CORE},
    "store.server": {"store.server", "store.api", "index.api", CORE},
    "index.server": {"index.server", "index.api", "store.api", CORE},
    "store.api": {"store.api", CORE},
    "index.api": {"index.api", "store.api", CORE},
    CORE: {CORE},
}


def imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
    return {m for m in out if m == "kvtier" or m.startswith("kvtier.")}


def known(name: str, all_modules: dict[str, Path]) -> str | None:
    """The module an imported name refers to (``from kvtier.x import y``: y may be a name)."""
    while name and name not in all_modules:
        name = name.rpartition(".")[0]
    return name or None


def test_one_dependency_direction() -> None:
    all_modules = modules()
    assert "kvtier.connector.scheduler" in all_modules and "kvtier.core.keys" in all_modules
    violations = []
    for module, path in sorted(all_modules.items()):
        allowed = ALLOWED[layer(module)]
        if allowed is None:
            continue
        for imported in imports(path, module):
            target = known(imported, all_modules)
            if target is None or layer(target) in allowed:
                continue
            if any(module.startswith(a) and target.startswith(b) for a, b in EXCEPTIONS):
                continue
            violations.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    assert not violations, "\n".join(violations)
