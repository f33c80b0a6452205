#!/usr/bin/env bash
# Run every test, suite by suite (run scripts/build_book.sh once first):
#
#   lint           ruff check, ruff format --check, and mypy over gradlab/
#   library        tests/lib: the library against torch.nn.utils and float64 maths
#   library-torch-2.14
#                  tests/lib again, in .venv-torch-2.14: the newest torch the library claims
#   packaging      tests/packaging: the two wheels (library, gradlab-book) built, their
#                  files, each in a fresh venv: imports, and the chapters that read data,
#                  run alone
#   integrations   tests/integrations, in .venv-integrations: gradlab inside Lightning,
#                  Accelerate, the Transformers Trainer and torchtitan's optimizer block
#   assignments    tests/assignments: the otter-grader assignments, graded round trip
#   book           tests/book (figures, exercise checks, student edition) and nbval,
#                  strict, on every notebook under book/
#   book-numerics  the book suite again under another CPU's float kernels
#                  (ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OPENBLAS_CORETYPE=Haswell):
#                  the committed outputs must not depend on the machine that wrote them.
#                  Every notebook and every module that computes a number; the modules
#                  that only read files (launchers, MyST, headers, the status page, the
#                  stored files' list, the student edition's stripping) run once, in book
#   browser        tests/browser: the built site in Chromium
#   pdf            tests/pdf: the PDF edition and the student PDF
# `bash scripts/test.sh library book` runs only the suites named. Each suite's time is
# printed at the end, then one line with the counts of all of them.
set -euo pipefail
cd "$(dirname "$0")/.."

suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(
  lint library library-torch-2.14 packaging integrations assignments book book-numerics
  browser pdf
)
wants() { [[ " ${suites[*]} " == *" $1 "* ]]; }

# Everything a suite needs is checked before any test runs.
problems=()
for env in .venv .venv-torch-2.14 .venv-integrations; do
  case $env in
    .venv-torch-2.14) wants library-torch-2.14 || continue ;;
    .venv-integrations) wants integrations || continue ;;
  esac
  [ -x "$env/bin/python" ] || problems+=("there is no $env: run 'bash scripts/build_book.sh' first")
done
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

# A failing suite does not stop the others; the script fails at the end. The suite runs
# in .venv, or in the environment named by PYTHON_ENV, with the variables of suite_env.
suite_env=()
run_suite() {
  local name=$1
  shift
  local t0=$SECONDS
  local python="${PYTHON_ENV:-.venv}/bin/python"
  echo "== $name: ${suite_env[*]} $python -m pytest $*"
  env "${suite_env[@]}" "$python" -m pytest -p no:cacheprovider \
    --junitxml="$results/$name.xml" "$@" || failed+=("$name")
  timings+=("$name $((SECONDS - t0)) s")
}
# Another CPU's float kernels, for the book-numerics suite.
second_numerics=(ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OPENBLAS_CORETYPE=Haswell)
book_args=(-n 2 --dist loadfile tests/book book
  --nbval --nbval-current-env --nbval-sanitize-with tests/book/nbval_sanitize.cfg)
structural_book_tests=(test_launchers test_myst_compat test_notebooks test_status_page
  test_stored test_student_edition)
numerics_args=("${book_args[@]}")
for module in "${structural_book_tests[@]}"; do
  numerics_args+=(--ignore "tests/book/$module.py")
done

if wants lint; then
  t0=$SECONDS
  { .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy; } ||
    failed+=(lint)
  timings+=("lint $((SECONDS - t0)) s")
fi
# Two workers; --dist loadfile keeps a module's multi-process world, and each notebook's
# cells, together in one worker (packaging: the library's venv beside the book's).
# The browser suite runs on one worker: on two cores, two Chromiums (a page's tests kept
# together) took as long, 1281 s against 1216 s, and timed out twice.
wants library && run_suite library -n 2 --dist loadfile tests/lib
wants library-torch-2.14 && PYTHON_ENV=.venv-torch-2.14 run_suite library-torch-2.14 \
  -n 2 --dist loadfile tests/lib
wants packaging && run_suite packaging -n 2 --dist loadfile tests/packaging
wants integrations && PYTHON_ENV=.venv-integrations run_suite integrations tests/integrations
wants assignments && run_suite assignments tests/assignments
wants book && run_suite book "${book_args[@]}"
if wants book-numerics; then
  suite_env=("${second_numerics[@]}")
  run_suite book-numerics "${numerics_args[@]}"
  suite_env=()
fi
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
