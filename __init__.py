"""kvtier: a tiered KV-cache store for LLM serving (GPU, node-shared DRAM, remote DRAM).

The repository root is this package: every top-level folder ``X/`` is ``kvtier.X``
(docs/design.md, "Layout"). ``__version__`` is the one place the version is written.
"""

__version__ = "0.2.0"
