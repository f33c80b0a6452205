#!/usr/bin/env bash
# Run every test, suite by suite (run scripts/build_book.sh once first):
#
#   lint       ruff check and ruff format --check
#   library    tests/lib: the library against torch.nn.utils and float64 maths
#   packaging  tests/packaging: the two wheels (library, gradlab-book) built, their files,
#              each in a fresh venv: imports, and the chapters that read data, run alone
#   book       tests/book (figures, exercise checks, student edition) and nbval, strict,
#              on every notebook under book/
#   browser    tests/browser: the built site in Chromium
#   pdf        tests/pdf: the PDF edition and the student PDF
# `bash scripts/test.sh library book` runs only the suites named. Each suite's time is
# printed at the end, then one line with the counts of all of them.
set -euo pipefail
cd "$(dirname "$0")/.."

suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(lint library packaging book browser pdf)
wants() { [[ " ${suites[*]} " == *" $1 "* ]]; }

# Everything a suite needs is checked before any test runs.
problems=()
[ -x .venv/bin/python ] || problems+=("there is no .venv: run 'bash scripts/build_book.sh' first")
if wants browser; then
  source scripts/system_deps.sh
  missing=$(missing_system_deps)
  [ -z "$missing" ] || problems+=("the browser tests need $missing: run 'bash scripts/build_book.sh' as root on Debian/Ubuntu, or install them")
  [ -f _build/html/index.html ] || problems+=("the book is not built: run 'bash scripts/build_book.sh'")
  [ -d tests/browser/node_modules ] || problems+=("tests/browser/node_modules is missing: run 'bash scripts/build_book.sh' (npm ci)")
fi
if wants pdf && ! { [ -f _build/pdf/gradlab.pdf ] && [ -f _build/pdf/gradlab-student.pdf ]; }; then
  problems+=("the PDF edition is not built: run 'bash scripts/build_book.sh' (or scripts/build_pdf.sh)")
fi
if [ ${#problems[@]} -gt 0 ]; then
  printf 'Cannot run the tests: %s.\n' "${problems[@]}" >&2
  exit 1
fi

results=test-artifacts/results
rm -rf "$results"
mkdir -p "$results"
timings=()
failed=()

# A failing suite does not stop the others; the script fails at the end.
run_suite() {
  local name=$1
  shift
  local t0=$SECONDS
  echo "== $name: pytest $*"
  .venv/bin/python -m pytest -p no:cacheprovider --junitxml="$results/$name.xml" "$@" ||
    failed+=("$name")
  timings+=("$name $((SECONDS - t0)) s")
}

if wants lint; then
  t0=$SECONDS
  { .venv/bin/ruff check . && .venv/bin/ruff format --check .; } || failed+=(lint)
  timings+=("lint $((SECONDS - t0)) s")
fi
wants library && run_suite library tests/lib
wants packaging && run_suite packaging tests/packaging
# Two workers; --dist loadfile keeps each notebook's cells together in one kernel.
wants book && run_suite book -n 2 --dist loadfile tests/book book \
  --nbval --nbval-current-env --nbval-sanitize-with tests/book/nbval_sanitize.cfg
wants browser && run_suite browser tests/browser
wants pdf && run_suite pdf tests/pdf

printf '%s\n' "== suite times:" "${timings[@]}"
if compgen -G "$results/*.xml" >/dev/null; then
  .venv/bin/python scripts/junit_total.py "$results"/*.xml || true
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED suites: ${failed[*]}" >&2
  exit 1
fi
