#!/usr/bin/env bash
# Set up everything and build the book: .venv with the pinned requirements and gradlab,
# then every notebook executed and the HTML written to _build/html (warnings are errors).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements.txt
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .

.venv/bin/jupyter-book build . -W -n --keep-going
echo "The book is in _build/html/index.html"
