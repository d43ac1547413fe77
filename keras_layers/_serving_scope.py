"""The frozen copies a ``CachedEmbedding`` serves through while
:func:`tf_sfctr.export_for_serving` traces a model it cannot rebuild (a
subclassed model, or a table inside a subclassed layer): within
:func:`serving_twins`, on the thread that entered it, each listed layer's
call returns its ``ServingEmbedding``'s output, so the traced serving
function reads the frozen rows with stock ops and never the live table."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

_LOCAL = threading.local()


@contextlib.contextmanager
def serving_twins(twins: dict) -> Iterator[None]:
    """``twins``: ``id(CachedEmbedding) -> ServingEmbedding``, for this
    thread until the block ends (other threads still train and read the
    live tables)."""
    previous = getattr(_LOCAL, "twins", None)
    _LOCAL.twins = twins
    try:
        yield
    finally:
        _LOCAL.twins = previous


def serving_twin(layer: Any) -> Optional[Any]:
    """The frozen copy ``layer`` serves through here and now, or None."""
    twins = getattr(_LOCAL, "twins", None)
    return None if twins is None else twins.get(id(layer))
