"""The book's own code: figures, explorables, demo models, exercise checks, benchmarks.

Nothing in the library (:mod:`gradlab`) imports this package. It needs the ``book``
extra, which brings numpy, matplotlib, pillow, ipywidgets and opacus (for the privacy
accounting of the per-sample chapter)::

    pip install "gradlab[book]"

* :mod:`gradlab.book.figures`: one module per topic of the book, computation apart
  from drawing;
* :mod:`gradlab.book.interactive`: figures live in a kernel, precomputed on the page;
* :mod:`gradlab.book.plots`: the house style;
* :mod:`gradlab.book.demos`: the seeded models and data the chapters train;
* :mod:`gradlab.book.exercises`: the self-checks of the coding exercises;
* :mod:`gradlab.book.benchmark`: the timing harness and the reference loops;
* :mod:`gradlab.book.headers` and :mod:`gradlab.book.student_edition`: tools that
  maintain the notebooks and write the edition without solutions.
"""

import importlib.util

_NEEDED = ("numpy", "matplotlib", "PIL", "ipywidgets")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"gradlab.book needs {', '.join(_missing)}, which the library alone does not "
        'install: pip install "gradlab[book]" (from a clone: pip install -e ".[book]")'
    )
