#!/usr/bin/env bash
# The CUDA copy path's checks on a GPU machine: tests/gpu (exactness of every vLLM CUDA KV
# layout, ordering against CUDA graph replays) and `kvtier bench kv-copy --device cuda`.
# Made for machines with a CUDA device and PyTorch but neither vLLM nor network (a GPU lent
# for the job): where kvtier is not importable it installs the wheels in .whl/ into
# /tmp/kvtier-site, and the vLLM shim of tests/gpu stands in for vLLM.
#   scripts/gpu_check.sh wheels     (on a machine with network) build .whl/: kvtier and what
#                                   such an image lacks, for Python 3.12
#   scripts/gpu_check.sh [OUT]      run everything; logs and JSON reports in OUT
#                                   (default results/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = wheels ]; then
  set -e
  rm -rf .whl && mkdir .whl
  .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
  rm -rf build ./*.egg-info
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl pydantic==2.14.3 pydantic-core==2.50.4 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0 msgspec==0.22.0
  ls .whl
  exit 0
fi

out=${1:-results/gpu}
mkdir -p "$out"
default_py=python3
[ -x .venv/bin/python ] && default_py=.venv/bin/python
PY=${PYTHON:-$default_py}
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import kvtier" 2>/dev/null; then
  if ! ls .whl/kvtier-*.whl >/dev/null 2>&1; then
    echo "kvtier is not importable by $PY and .whl/ is empty: run '$0 wheels' first" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvtier-site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/kvtier-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  export PYTHONPATH=$PWD/tests/gpu/vllm_shim:$PYTHONPATH
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc; df -h /dev/shm
} 2>&1 | tee "$out/machine.txt"
status=0
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  "$PY" -m pytest tests/gpu --confcutdir tests/gpu -p no:cacheprovider -q -rs 2>&1 | tail -3
  echo "no CUDA device here: tests/gpu skip (reasons above), nothing to measure"
  exit 0
fi
# the benchmark's pool holds 4 GiB of KV at 32k tokens; container /dev/shm is often smaller
shm_kib=$(df -k --output=size /dev/shm | tail -1)
if [ "$shm_kib" -lt $((16 << 20)) ] && [ "$(id -u)" = 0 ]; then
  mount -o remount,size=32G /dev/shm && df -h /dev/shm | tee -a "$out/machine.txt"
fi

"$PY" -m pytest tests/gpu --confcutdir tests/gpu -p no:cacheprovider -q -rs -o timeout=60 2>&1 \
  | tee "$out/tests.log" || status=1
kvtier() { timeout 240 "$PY" -c "import sys; from kvtier.cli import main; sys.argv[0] = 'kvtier'; main()" "$@"; }
kvtier bench kv-copy --device cuda --tokens 8192,32768 --json "$out/kv-copy-flash-attn.json" \
  2>&1 | tee "$out/bench.log" || status=1
for chunk in 512 1024; do
  kvtier bench kv-copy --device cuda --tokens 8192,32768 --chunk-tokens "$chunk" --repeat 3 \
    --json "$out/kv-copy-flash-attn-chunk$chunk.json" 2>&1 | tee -a "$out/bench.log" || status=1
done
for case in cross-layer-nhd mla; do
  kvtier bench kv-copy --device cuda --case "$case" --tokens 8192 --repeat 3 \
    --json "$out/kv-copy-$case.json" 2>&1 | tee -a "$out/bench.log" || status=1
done
exit $status
