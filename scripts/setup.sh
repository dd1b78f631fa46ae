#!/usr/bin/env bash
# Set up everything from scratch on a fresh Debian machine (idempotent):
#   .venv with torch 2.13 (CPU), the project (editable) with its test/serve/bench/disagg/kernels extras
#   (kernels: Triton-lang, whose CPU interpreter runs the Triton kernel's tests),
#   the native build (CPU library, CUDA kernels for sm_80/sm_90 when nvcc exists, TensorRT plugins) + ctest,
#   the real Triton server (nvidia-pytriton 0.7.0) and perf_analyzer 2.51.
# Usage: bash scripts/setup.sh            (SKIP_NATIVE=1 / SKIP_TRITON=1 to skip those parts)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '[setup] %s\n' "$*"; }

if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  log "installing python3-venv"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv
fi
if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
log "installing torch 2.13.0 (CPU) and the project"
python -m pip install -q "torch==2.13.0"
python -m pip install -q "torch==2.13.0" -e ".[test,serve,bench,disagg,kernels]"  # torch pinned with nixl (disagg)

if [[ "${SKIP_NATIVE:-0}" != 1 ]]; then
  log "native build"
  bash scripts/setup_native.sh
fi
if [[ "${SKIP_TRITON:-0}" != 1 ]]; then
  log "Triton server and perf_analyzer"
  bash scripts/setup_triton.sh
fi
log "ready: . .venv/bin/activate"
