#!/usr/bin/env bash
# Run every test: lint, the gradlab unit tests, nbval on every notebook (strict), and the
# browser tests of the built site (tests/browser: Debian's Chromium, /usr/bin/chromium,
# and npm for the local MathJax copy, installed on first use). Run scripts/build_book.sh
# once first. Screenshots of every page go to test-artifacts/screenshots/.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "No .venv here: run 'bash scripts/build_book.sh' first." >&2
  exit 1
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
