#!/usr/bin/env bash
# Create .venv in the repository root with everything the project needs on a CPU-only machine.
# Idempotent: when the lock file and the project's metadata are unchanged it returns in seconds.
#
#   SGLang 0.5.23 is installed with --no-deps (its declared dependencies are a CUDA tree) together
#   with the exact set it needs to import and serve, pinned in requirements/cpu.lock. A .pth file
#   registers sglang_kvsparse.server.cpu_shims (a stand-in for the CUDA-only sgl_kernel, active only
#   with SGLANG_USE_CPU_ENGINE=1 and no real sgl_kernel). The lent GPU's Triton (3.6) goes into
#   .venv/triton-3.6, for the sm_90 compile check only. The embedded model is converted once.
#   For a GPU install see the README ("Running on a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv"
source scripts/venv_from_lock.sh

venv_from_lock "$venv" "$root/requirements/cpu.lock" setup
# Written every time (cheap), so an environment built before the shim existed gets it too.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sglang_kvsparse.server.cpu_shims" > "$site/sglang_kvsparse_cpu.pth"

# The lent GPU's Triton beside the environment, for the sm_90 compile check (bench/compile_check.py).
triton36="$venv/triton-3.6"
if [ ! -f "$triton36/.lock" ] || ! cmp -s "$triton36/.lock" requirements/triton36.lock; then
    rm -rf "$triton36"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$triton36" -r requirements/triton36.lock
    cp requirements/triton36.lock "$triton36/.lock"
fi

# Convert the embedded model now rather than on the first launch (about 20 s, once).
"$venv/bin/python" -m sglang_kvsparse.models path >/dev/null
echo "[setup] ready: $venv"
