#!/usr/bin/env bash
# Create .venv in the repository root with everything the project needs on a CPU-only machine.
# Idempotent: when the lock file and the project's metadata are unchanged it returns in seconds.
#
#   SGLang 0.5.23 is installed with --no-deps (its declared dependencies are a CUDA tree) together
#   with the exact set it needs to import and serve, pinned in requirements/cpu.lock. A .pth file
#   registers sglang_kvsparse.cpu_shims (a stand-in for the CUDA-only sgl_kernel, active only
#   with SGLANG_USE_CPU_ENGINE=1 and no real sgl_kernel). The embedded model is converted once.
#   For a GPU install see the README ("Running on a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv"
lock="$root/requirements/cpu.lock"
python=${PYTHON:-python3}

stamp_of() { cat "$lock" "$root/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1; }
stamp_file="$venv/.kvsparse-setup-stamp"

if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$(stamp_of)" ]; then
    echo "[setup] .venv is up to date"
else
    echo "[setup] creating $venv (about 3 minutes on a fresh machine)"
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install -q --upgrade "pip==24.3.1" "wheel==0.48.0" "setuptools==84.2.1"
    "${pip[@]}" install -q --no-deps -r "$lock"
    "${pip[@]}" install -q --no-deps --no-build-isolation -e "$root"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "import sglang_kvsparse.cpu_shims" > "$site/sglang_kvsparse_cpu.pth"
    stamp_of > "$stamp_file"
fi

# Convert the embedded model now rather than on the first launch (about 20 s, once).
"$venv/bin/python" -m sglang_kvsparse.models path >/dev/null
echo "[setup] ready: $venv"
