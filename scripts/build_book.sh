#!/usr/bin/env bash
# Set up everything, then build the book.
#
#  1. .venv with the pinned requirements.txt (torch 2.13.0, CPU wheel), the library
#     (gradlab) and the book's distribution (gradlab-book), both editable;
#  2. what the browser tests need outside Python: Chromium and Node.js/npm (through
#     apt-get on Debian or Ubuntu as root; elsewhere one sentence says what to install),
#     and the local copies of the CDN files the pages load (npm ci in tests/browser);
#  3. the HTML book in _build/html, from the notebooks' committed outputs, warnings as
#     errors. The tests re-execute every notebook and compare those outputs (nbval);
#  4. the PDF edition and the student edition's PDF in _build/pdf (scripts/build_pdf.sh,
#     which installs TeX Live the same way). GRADLAB_PDF=0 leaves the PDFs out.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements.txt
# requirements.txt pins the dependencies of the library and its test extra, of the book's
# distribution and of the book's toolchain; --no-deps keeps pip from resolving them again.
.venv/bin/python -m pip install --quiet --no-deps -e . -e ./gradlab-book

source scripts/system_deps.sh
install_system_deps
if command -v npm >/dev/null 2>&1; then
  npm ci --prefix tests/browser --no-audit --no-fund --loglevel=error
fi

rm -rf _build/html
.venv/bin/jupyter-book build . -W -n --keep-going
echo "The book is in _build/html/index.html"
if [ "${GRADLAB_PDF:-1}" != 0 ]; then
  bash scripts/build_pdf.sh
fi
echo "Set-up and build: $((SECONDS - start)) s"
