# Sourced by scripts/setup.sh and scripts/setup-kvpress.sh: build a virtual environment from a
# fully pinned lock file, installed with --no-deps so pip never re-resolves it, plus the project
# itself (editable, no dependencies). Skipped when a stamp of the lock, pyproject.toml and the
# calling script says nothing changed since the last build.
#
#   venv_from_lock VENV LOCK LABEL

venv_from_lock() {
    local venv=$1 lock=$2 label=$3
    local root
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    local stamp_file="$venv/.kvsparse-setup-stamp"
    local stamp
    stamp=$(cat "$lock" "$root/pyproject.toml" "$0" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ]; then
        echo "[$label] $venv is up to date"
        return 0
    fi
    echo "[$label] creating $venv (a few minutes on a fresh machine)"
    "${PYTHON:-python3}" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
    "${pip[@]}" install -q --upgrade "pip==24.3.1" "wheel==0.48.0" "setuptools==84.2.1"
    "${pip[@]}" install -q --no-deps -r "$lock"
    "${pip[@]}" install -q --no-deps --no-build-isolation -e "$root"
    # The test bed is not in the wheel (pyproject.toml): these environments import it from the checkout.
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ln -sfn "$root/testbed" "$site/kvsparse_testbed"
    echo "$stamp" > "$stamp_file"
}
