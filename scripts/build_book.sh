#!/usr/bin/env bash
# Set up everything, then build the book.
#
#  1. .venv with the pinned requirements.txt (torch 2.13.0, CPU wheel), the library
#     (gradlab) and the book's distribution (gradlab-book), both editable; and two more
#     environments, each with the library editable: .venv-torch-2.14 (the library suite
#     on the newest torch, requirements-torch-2.14.txt) and .venv-integrations (the
#     trainers, requirements-integrations.txt);
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

# The other environments: every line of their requirements is pinned, so --no-deps.
# torch first and alone, pinned, so that nothing pulls in a second torch.
make_env() {
  local env=$1 requirements=$2 torch=$3
  [ -x "$env/bin/python" ] || "$python" -m venv "$env"
  "$env/bin/python" -m pip install --quiet --upgrade pip
  "$env/bin/python" -m pip install --quiet --no-deps "torch==$torch"
  "$env/bin/python" -m pip install --quiet --no-deps -r "$requirements"
  "$env/bin/python" -m pip install --quiet --no-deps -e .
}
# They install (several GB, mostly unpacking) while the rest below runs; one after the
# other, since each installs the library editable from this folder.
{
  make_env .venv-torch-2.14 requirements-torch-2.14.txt 2.14.1
  make_env .venv-integrations requirements-integrations.txt 2.13.0
} &
other_envs=$!

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
wait "$other_envs" || {
  echo "Installing .venv-torch-2.14 or .venv-integrations failed (pip's error is above)." >&2
  exit 1
}
echo "Set-up and build: $((SECONDS - start)) s"
