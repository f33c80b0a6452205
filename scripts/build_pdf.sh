#!/usr/bin/env bash
# Build the PDF edition of the book (run scripts/build_book.sh once first, for .venv):
#
#   _build/pdf/gradlab.pdf          the whole book: numbered parts and chapters, every
#                                   figure (an explorable at its default frame), the maths
#                                   typeset with the book's macros, the exercises, and the
#                                   solutions in an appendix chapter, "Solutions";
#   _build/pdf/gradlab-student.pdf  the student edition: the same book built from the
#                                   stripped notebooks (python -m booktools.student_edition
#                                   --pdf), without the solutions or the instructors' page;
#
# each with its XeLaTeX log beside it (tests/pdf reads both). Jupyter Book's LaTeX route
# (--builder pdflatex) with XeLaTeX (latex: in _config.yml), from the notebooks' committed
# outputs; book/_ext/gradlab_latex.py adds the macros, the figures' frames and the
# solutions appendix. TeX Live comes from Debian's packages: apt-get installs them here on
# Debian or Ubuntu as root; elsewhere one sentence says what to install.
#
# The build writes to _build/pdf only (its Sphinx environment is _build/pdf/work), so it
# never touches the HTML build in _build/html or its cache. Then: bash scripts/test.sh pdf
# (or .venv/bin/python -m pytest tests/pdf).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if [ ! -x .venv/bin/python ]; then
  echo "There is no .venv: run 'bash scripts/build_book.sh' first." >&2
  exit 1
fi

# Debian packages: XeLaTeX and the LaTeX packages Sphinx and sphinx-jupyterbook-latex load,
# latexmk, the FreeFont OpenType fonts (Sphinx's XeLaTeX default), and poppler-utils
# (pdfinfo, pdftotext, pdfimages, pdftoppm) for the tests.
TEX_PACKAGES=(texlive-xetex texlive-latex-extra texlive-fonts-recommended latexmk
  fonts-freefont-otf poppler-utils)

missing_tex() {
  local missing=()
  command -v xelatex >/dev/null 2>&1 || missing+=(texlive-xetex)
  command -v latexmk >/dev/null 2>&1 || missing+=(latexmk)
  command -v pdftoppm >/dev/null 2>&1 || missing+=(poppler-utils)
  if command -v kpsewhich >/dev/null 2>&1; then
    [ -n "$(kpsewhich fncychap.sty pgfplots.sty)" ] || missing+=(texlive-latex-extra)
  fi
  [ -f /usr/share/fonts/opentype/freefont/FreeSerif.otf ] ||
    fc-list 2>/dev/null | grep -q FreeSerif || missing+=(fonts-freefont-otf)
  echo "${missing[@]}"
}

missing=$(missing_tex)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing TeX Live with apt-get: ${TEX_PACKAGES[*]}"
    t0=$SECONDS
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${TEX_PACKAGES[@]}" >/dev/null
    echo "TeX Live installed in $((SECONDS - t0)) s"
  else
    echo "The PDF needs XeLaTeX, latexmk, FreeFont and poppler-utils: install them" \
      "(Debian/Ubuntu: sudo apt-get install --no-install-recommends ${TEX_PACKAGES[*]})." >&2
    exit 1
  fi
fi

out=_build/pdf
rm -rf "$out"
mkdir -p "$out"

# The two editions build side by side (each is one Sphinx and one XeLaTeX process), each
# with its output in a log that is printed if it fails.
build_edition() {
  t0=$SECONDS
  .venv/bin/jupyter-book build . --builder pdflatex --path-output "$out/work" -W -n \
    --keep-going
  cp "$out/work/_build/latex/gradlab.pdf" "$out/work/_build/latex/gradlab.log" "$out/"
  echo "gradlab.pdf: $((SECONDS - t0)) s"
}
build_student_edition() {
  t0=$SECONDS
  .venv/bin/python -m booktools.student_edition "$out/student" --root . --no-html --pdf
  cp "$out/student/pdf/gradlab-student.pdf" "$out/student/pdf/gradlab-student.log" "$out/"
  echo "gradlab-student.pdf: $((SECONDS - t0)) s"
}
build_edition >"$out/edition-build.txt" 2>&1 &
edition=$!
build_student_edition >"$out/student-build.txt" 2>&1 &
student=$!
failed=()
wait "$edition" || failed+=("$out/edition-build.txt")
wait "$student" || failed+=("$out/student-build.txt")
for log in "${failed[@]}"; do
  echo "== the build in $log failed; its last lines:" >&2
  tail -n 60 "$log" >&2
done
[ ${#failed[@]} -eq 0 ] || exit 1
tail -n 1 "$out/edition-build.txt" "$out/student-build.txt" | grep '\.pdf:'

for pdf in "$out/gradlab.pdf" "$out/gradlab-student.pdf"; do
  pages=$(pdfinfo "$pdf" | awk '/^Pages:/ {print $2}')
  echo "$pdf: $pages pages, $(du -h "$pdf" | cut -f1)"
done
echo "The PDF edition is in $out (build: $((SECONDS - start)) s)"
