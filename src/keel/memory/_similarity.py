"""Dot products for search that never wake the BLAS thread pool.

numpy's ``@`` hands any product above a small size (40 x 384 x 40 already) to OpenBLAS, which
splits it over its worker threads; after each call those workers spin for a while waiting for
more work instead of sleeping. A search runs one such product every few tens of milliseconds,
so the workers never sleep: on a 2-core machine one core is burnt for nothing while the
query embedding, SQLite's FTS5 and the PostgreSQL server wait for it (PostgreSQL search at
100k: p50 44 ms against 31 ms). These products are small or memory-bound, where a second
thread gains little, so they run single-threaded through ``einsum``'s own loops, which never
enter BLAS and are as fast as single-threaded BLAS here.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["row_dots"]

FloatArray = npt.NDArray[np.float32]


def row_dots(matrix: FloatArray, vector: FloatArray) -> FloatArray:
    """``matrix @ vector`` (one dot product per row), on the calling thread only."""
    result: FloatArray = np.einsum("ij,j->i", matrix, vector)
    return result
