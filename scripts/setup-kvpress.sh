#!/usr/bin/env bash
# Create .venv-kvpress in the repository root: NVIDIA kvpress, the external accuracy reference of
# bench/fidelity_kvpress.py. Idempotent: when the lock file and the project's metadata are unchanged
# it returns in seconds.
#
#   kvpress 0.5.5 pins transformers 5.2 while SGLang 0.5.23 needs 5.19, so kvpress gets its own
#   environment (about 1.5 GB, about a minute): torch 2.13.0 (CPU build), transformers, kvpress and
#   the essay corpus, all pinned in requirements/kvpress.lock and installed with --no-deps so pip
#   never re-resolves them. The project is installed editable (no dependencies) so the benchmark
#   imports kvsparse_testbed.retrieval, .texts and sglang_kvsparse.models, which need nothing heavy.
#   The model itself is the one scripts/setup.sh converts (the conversion needs packages of .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv-kvpress"
source scripts/venv_from_lock.sh

venv_from_lock "$venv" "$root/requirements/kvpress.lock" setup-kvpress

if [ -x "$root/.venv/bin/python" ]; then
    echo "[setup-kvpress] model: $("$root/.venv/bin/python" -m sglang_kvsparse.models path)"
else
    echo "[setup-kvpress] run scripts/setup.sh too: it converts the model both environments load"
fi
echo "[setup-kvpress] ready: $venv"
