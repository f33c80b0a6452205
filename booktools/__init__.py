"""The repository's tools for the book's sources; never installed, never shipped.

Each runs from the repository root with the project's environment, and finds the
repository by its own location (``booktools/`` sits at its root):

* ``python -m booktools.headers``: the two generated header cells of every notebook
  (the book's macros, and the setup cell that installs the packages in a fresh kernel);
* ``python -m booktools.myst_compat``: citations and cross-references as Markdown
  links that JupyterLab and Jupyter Book both resolve;
* ``python -m booktools.student_edition OUTDIR``: the edition without solutions;
* ``python -m booktools.assignments OUT``: the chapters as otter-grader assignments
  (``grade``: grade them locally);
* ``python -m booktools.hero``: the introduction's hero figure, a file the page includes.

They need nbformat and PyYAML (``requirements.txt``), which neither ``gradlab`` nor
``gradlab-book`` installs.
"""
