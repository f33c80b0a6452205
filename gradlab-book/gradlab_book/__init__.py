"""The book's own code: figures, explorables, demo models, exercise checks, stored data.

A distribution of its own, ``gradlab-book``, versioned with the book (3.0 is the third
edition). It depends on the library, :mod:`gradlab`, and brings numpy, matplotlib,
pillow, ipywidgets and opacus (for the privacy accounting of the per-sample chapter);
nothing in the library imports it::

    pip install gradlab-book            # from a clone: pip install -e ./gradlab-book

* :mod:`gradlab_book.figures`: one module per topic of the book, computation apart
  from drawing;
* :mod:`gradlab_book.interactive`: figures live in a kernel, precomputed on the page;
* :mod:`gradlab_book.plots`: the house style;
* :mod:`gradlab_book.demos`: the seeded models and data the chapters train;
* :mod:`gradlab_book.exercises`: the self-checks of the coding exercises;
* :mod:`gradlab_book.benchmark`: the timing harness and the reference loops;
* :mod:`gradlab_book.stored`: the data files the experiments wrote, shipped in the
  package (``gradlab_book/data/``) so that a chapter runs wherever it is opened.

The tools that maintain the notebooks are not part of it: they are the repository's
``booktools`` package.
"""

import importlib.util

__version__ = "3.0.0.dev0"

_NEEDED = ("numpy", "matplotlib", "PIL", "ipywidgets")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        f"gradlab_book needs {', '.join(_missing)}, which are not installed: "
        "pip install gradlab-book (from a clone: pip install -e ./gradlab-book)"
    )
