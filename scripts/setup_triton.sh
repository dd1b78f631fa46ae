#!/usr/bin/env bash
# Make the real Triton Inference Server and perf_analyzer usable on a CPU-only machine.
#
# Idempotent; run it with the project's virtualenv active (or VIRTUAL_ENV pointing at it):
#   . .venv/bin/activate && scripts/setup_triton.sh
#
# What it does (recipe measured in ENVIRONMENT.md):
#   1. installs nvidia-pytriton==0.7.0 (bundles tritonserver 2.51 + the Python backend), numpy<2 and
#      tritonclient[grpc,http] into the active venv;
#   2. checks that the shared libpython3.11 the 3.11 backend stub links against is present
#      (installs Debian's libpython3.11 when running as root with apt-get available);
#   3. downloads the tritonclient==2.51.0 manylinux1 wheel into .tools/wheels/, extracts the real
#      perf_analyzer binary to .tools/perf_analyzer/bin/, symlinks libb64.so.0d and libcudart.so.12
#      from nvidia_pytriton.libs into .tools/perf_analyzer/lib/, and writes the wrapper
#      .tools/bin/perf_analyzer that sets LD_LIBRARY_PATH;
#   4. smoke-checks both binaries;
#   5. only with WITH_GENAI_PERF=1: installs genai-perf 0.0.8 (the oldest release on PyPI, of Triton's
#      24.11 line; seen working with perf_analyzer 2.51 — 0.0.16 wants its own perf-analyzer package) and
#      its dependencies (~650 MB: pandas, pyarrow, plotly,
#      statsmodels, ...) into .tools/genai-perf/site, outside the project venv, pinned to versions seen
#      working with numpy<2, and writes the wrapper .tools/bin/genai-perf (`dhisparse-bench --genai-perf`);
#   6. only with WITH_AIPERF=1: installs AIPerf 0.13.0 (genai-perf's successor; it needs numpy 2 and pulls
#      transformers, datasets, pyarrow, ... ~1.2 GB) into its own virtualenv .tools/aiperf/, and writes the wrapper
#      .tools/bin/aiperf (`dhisparse-bench --aiperf`, against the OpenAI API).
# The Triton backend directory itself is assembled by `dhisparse-serve` at every start.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"
PY="${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/}python"
if [[ -z "${VIRTUAL_ENV:-}" && -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
fi
echo "[setup_triton] python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# 1. Python packages (pip is a no-op when they are already satisfied).
"$PY" -m pip install --quiet "nvidia-pytriton==0.7.0" "numpy<2" "tritonclient[grpc,http]>=2.51"

SITE="$("$PY" -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parents[1])')"
LIBS="$SITE/nvidia_pytriton.libs"
TRITON="$SITE/pytriton/tritonserver"
for f in "$TRITON/bin/tritonserver" "$TRITON/backends/python/libtriton_python.so" \
         "$TRITON/python_backend_stubs/3.11/triton_python_backend_stub"; do
    [[ -e "$f" ]] || { echo "[setup_triton] missing $f (broken nvidia-pytriton install?)" >&2; exit 1; }
done

# 2. The 3.11 stub needs a shared libpython3.11.
if ! ldconfig -p | grep -q 'libpython3\.11\.so\.1\.0'; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get install -y --no-install-recommends libpython3.11 >/dev/null
    else
        echo "[setup_triton] libpython3.11.so.1.0 not found: install Debian's libpython3.11" >&2
        exit 1
    fi
fi

# 3. perf_analyzer 2.51 from the tritonclient manylinux1 wheel.
PA_DIR="$TOOLS/perf_analyzer"
if [[ ! -x "$PA_DIR/bin/perf_analyzer" ]]; then
    mkdir -p "$TOOLS/wheels" "$PA_DIR/bin"
    WHEEL="$TOOLS/wheels/tritonclient-2.51.0-py3-none-manylinux1_x86_64.whl"
    if [[ ! -f "$WHEEL" ]]; then
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
            tritonclient==2.51.0 -d "$TOOLS/wheels"
    fi
    "$PY" - "$WHEEL" "$PA_DIR/bin/perf_analyzer" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("tritonclient-2.51.0.data/data/bin/perf_analyzer") as src:
    with open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
    chmod +x "$PA_DIR/bin/perf_analyzer"
fi
mkdir -p "$PA_DIR/lib" "$TOOLS/bin"
ln -sf "$(ls "$LIBS"/libb64-*.so.0d | head -n1)" "$PA_DIR/lib/libb64.so.0d"
ln -sf "$(ls "$LIBS"/libcudart-*.so.12* | head -n1)" "$PA_DIR/lib/libcudart.so.12"
cat > "$TOOLS/bin/perf_analyzer" <<EOF
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$PA_DIR/lib:$LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$PA_DIR/bin/perf_analyzer" "\$@"
EOF
chmod +x "$TOOLS/bin/perf_analyzer"

# 4. Smoke checks: both binaries load their libraries (`--help` exits non-zero, so grep its text).
HELP="$(LD_LIBRARY_PATH="$LIBS" "$TRITON/bin/tritonserver" --help 2>&1 || true)"
grep -q 'Usage: tritonserver' <<<"$HELP" \
    || { echo "[setup_triton] tritonserver does not start" >&2; exit 1; }
VERSION="$("$TOOLS/bin/perf_analyzer" --version 2>&1 || true)"
grep -q 'Perf Analyzer Version 2.51' <<<"$VERSION" \
    || { echo "[setup_triton] perf_analyzer does not start" >&2; exit 1; }
echo "[setup_triton] tritonserver: $TRITON/bin/tritonserver"
echo "[setup_triton] perf_analyzer: $TOOLS/bin/perf_analyzer"

# 5. Optional: genai-perf 0.0.8 on the same perf_analyzer (dhisparse-bench --genai-perf).
if [[ "${WITH_GENAI_PERF:-0}" == 1 ]]; then
    GP="$TOOLS/genai-perf"
    if [[ ! -f "$GP/site/genai_perf/main.py" ]]; then
        # --no-deps with an explicit, pinned list: genai-perf's own requirements pull numpy 2 / pandas 3,
        # and the Triton stub needs numpy<2 (pandas 3 does not import with it).
        "$PY" -m pip install --quiet --no-deps --target "$GP/site" genai-perf==0.0.8 pandas==2.2.3 \
            pyarrow==26.0.1 plotly==7.1.0 statsmodels==0.15.0 scipy==1.17.1 patsy==1.0.3 fastparquet==2026.9.0 \
            cramjam==2.14.0 fsspec==2026.9.0 narwhals==2.29.0 responses==0.26.3 pytest-mock==3.17.0 \
            python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 requests==2.34.2 urllib3==2.8.0 idna==3.20 \
            charset-normalizer==3.5.3 certifi==2026.10.19.post1
    fi
    PY_ABS="$("$PY" -c 'import sys; print(sys.executable)')"
    cat > "$TOOLS/bin/genai-perf" <<EOF
#!/usr/bin/env bash
export PATH="$TOOLS/bin:\$PATH" PYTHONPATH="$GP/site\${PYTHONPATH:+:\$PYTHONPATH}" HF_HUB_OFFLINE=1
exec "$PY_ABS" -m genai_perf.main "\$@"
EOF
    chmod +x "$TOOLS/bin/genai-perf"
    "$TOOLS/bin/genai-perf" --version 2>&1 | grep -q 'genai-perf 0.0.8' \
        || { echo "[setup_triton] genai-perf does not start" >&2; exit 1; }
    echo "[setup_triton] genai-perf: $TOOLS/bin/genai-perf"
fi

# 6. Optional: AIPerf 0.13 in its own virtualenv (dhisparse-bench --aiperf).
if [[ "${WITH_AIPERF:-0}" == 1 ]]; then
    AP="$TOOLS/aiperf"
    BASE_PY="$("$PY" -c 'import sys; print(sys._base_executable)')"
    if [[ ! -x "$AP/bin/aiperf" ]]; then
        "$BASE_PY" -m venv "$AP"
        "$AP/bin/python" -m pip install --quiet --disable-pip-version-check "aiperf==0.13.0"
    fi
    mkdir -p "$TOOLS/bin"
    cat > "$TOOLS/bin/aiperf" <<EOF
#!/usr/bin/env bash
# AIPerf loads a local tokenizer directory only when HF_HUB_OFFLINE is unset (it makes no request for a path)
unset HF_HUB_OFFLINE
exec "$AP/bin/aiperf" "\$@"
EOF
    chmod +x "$TOOLS/bin/aiperf"
    "$TOOLS/bin/aiperf" --version 2>&1 | grep -q '0.13.0' || { echo "[setup_triton] aiperf does not start" >&2; exit 1; }
    echo "[setup_triton] aiperf: $TOOLS/bin/aiperf"
fi
