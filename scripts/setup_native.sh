#!/usr/bin/env bash
# Builds and tests the native half of Adaptive DHiSparse (see plugins/README.md), idempotently, from scratch
# on a Debian machine with python3.11 and the project's virtualenv active:
#   1. build tools (cmake >= 3.24, ninja, g++) from Debian when missing,
#   2. TensorRT 10.14 C++ headers: `pip install --no-deps kernel-lens==2.0.1` (kernel_lens/include/tensorrt),
#      and the tensorrt-lean runtime the registry tests load the plugins into,
#   3. cmake configure + build into build/native (CPU library; CUDA kernels for sm_80/sm_90 when nvcc is at
#      $CUDACXX or /usr/local/cuda/bin/nvcc; TensorRT plugins), warnings as errors,
#   4. ctest.
# Environment: JOBS (default 2), BUILD_DIR (default build/native), CMAKE_ARGS (extra configure flags).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/native}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python}"

log() { printf '[setup_native] %s\n' "$*"; }

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
if ((${#need_apt[@]})); then
  log "installing ${need_apt[*]} from Debian"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  log "warning: no virtualenv active; pip installs go to $("$PYTHON" -c 'import sys; print(sys.prefix)')"
fi
has_module() { "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if ! has_module kernel_lens; then
  log "installing TensorRT 10.14 headers (kernel-lens==2.0.1, no dependencies)"
  "$PYTHON" -m pip install -q --no-deps kernel-lens==2.0.1
fi
if ! has_module tensorrt_lean; then
  log "installing the tensorrt-lean runtime (plugin registry tests)"
  "$PYTHON" -m pip install -q tensorrt-lean==11.4.0.106
fi

generator=()
command -v ninja >/dev/null 2>&1 && [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]] && generator=(-G Ninja)
log "configuring $BUILD_DIR"
# shellcheck disable=SC2086
cmake -S "$ROOT" -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDHS_WARNINGS_AS_ERRORS=ON \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${CMAKE_ARGS:-}
log "building with $JOBS jobs"
cmake --build "$BUILD_DIR" -j "$JOBS"
log "running ctest"
ctest --test-dir "$BUILD_DIR" --output-on-failure
log "done: $(ls "$BUILD_DIR"/plugins/*.so "$BUILD_DIR"/plugins/tensorrt/*.so 2>/dev/null | tr '\n' ' ')"
