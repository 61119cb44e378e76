#!/usr/bin/env bash
# Notebook 01 in JupyterLab, in a real (headless) browser: starts `jupyter lab notebooks/` on
# 127.0.0.1 (a free port, a token, --no-browser; root allowed), opens 01_bf16_rounding.py as a
# notebook in headless Chromium (Selenium), runs all cells (smoke settings, run_dir in a temporary
# folder), checks the bf16 explorer widget renders and answers a new value, and writes
# docs/browser_check/notebook01.png and docs/browser_check/log.txt. JupyterLab is shut down in
# every case; the exit code is 0 only when every check passed. Run it whenever the notebooks change.
#
# Needs: the lab extra and Selenium in the venv, Debian's chromium and chromium-driver:
#   .venv/bin/pip install -c constraints.txt -e ".[lab]" selenium
#   apt-get install -y chromium chromium-driver
# Options go to scripts/browser_check.py (--help); PYTHON=... picks another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || { echo "browser_check: no $PYTHON (make the venv first, or set PYTHON=)" >&2; exit 2; }
missing=()
for mod in jupyterlab jupytext ipywidgets ipykernel selenium; do
    "$PYTHON" -c "import $mod" 2>/dev/null || missing+=("$mod")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "browser_check: missing in $PYTHON: ${missing[*]}" >&2
    echo "  $PYTHON -m pip install -c constraints.txt -e \".[lab]\" selenium" >&2
    exit 2
fi
for cmd in chromium chromedriver; do
    command -v "$cmd" >/dev/null || { echo "browser_check: no $cmd: apt-get install -y chromium chromium-driver" >&2; exit 2; }
done

exec "$PYTHON" scripts/browser_check.py --python "$PYTHON" "$@"
