#!/usr/bin/env bash
# Build the chapters' otter-grader assignments (run scripts/build_book.sh once first, for
# .venv with the pinned otter-grader):
#
#   bash scripts/build_assignments.sh                    every chapter
#   bash scripts/build_assignments.sh clip_norm agc      the chapters named (notebook names)
#   bash scripts/build_assignments.sh --out DIR ...      elsewhere than _build/assignments
#   bash scripts/build_assignments.sh --no-run-tests ... without grading the solutions
#
# For each chapter it writes _build/assignments/CHAPTER/: student/CHAPTER.ipynb to hand
# out, autograder/CHAPTER-autograder.zip for Gradescope or otter (and autograder/CHAPTER.ipynb,
# the solutions), master/, the Otter Assign notebook it made them from, and questions.csv,
# the questions and their points (_build/assignments/questions.csv: every chapter built
# there). Unless --no-run-tests is given,
# the solutions notebook of each chapter is graded against its autograder (one run of the
# chapter each), and the build fails if it does not score full marks.
# PYTHON=path/to/python runs it with another environment than .venv (one with otter-grader,
# gradlab and gradlab-book). book/instructors.md explains the workflow.
set -euo pipefail
cd "$(dirname "$0")/.."

out=_build/assignments
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --out)
      out=${2:?--out needs a folder}
      shift 2
      ;;
    --no-run-tests)
      args+=(--no-run-tests)
      shift
      ;;
    -*)
      echo "unknown option $1 (see the head of $0)" >&2
      exit 2
      ;;
    *)
      args+=(--chapter "$1")
      shift
      ;;
  esac
done

python=${PYTHON:-.venv/bin/python}
if [ ! -x "$python" ]; then
  echo "There is no $python: run 'bash scripts/build_book.sh' first." >&2
  exit 1
fi
if ! "$python" -c "import otter, gradlab_book" 2>/dev/null; then
  echo "$python has no otter-grader or gradlab-book: run 'bash scripts/build_book.sh'" \
    "(requirements.txt pins otter-grader)." >&2
  exit 1
fi

start=$SECONDS
"$python" -m booktools.assignments "$out" "${args[@]}"
echo "Built in $((SECONDS - start)) s: $out"
