#!/usr/bin/env bash
# Run every test: lint, the gradlab unit tests, nbval on every notebook (strict), and the
# browser tests of the built site. Run scripts/build_book.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "No .venv here: run 'bash scripts/build_book.sh' first." >&2
  exit 1
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
