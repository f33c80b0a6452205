"""The book's figures: pure functions from parameters to data and to matplotlib figures.

One module per topic. Each separates the computation (tested against torch and the
math) from the drawing, so a notebook cell is a single call and every figure can be
precomputed for the static page with :func:`gradlab_book.interactive.explore`.
"""
