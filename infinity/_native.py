"""The compiled extensions (infinity._aio, infinity._adam), with an error that says what to do
when they are missing: importing infinity from a source checkout that was never built finds
the Python files but not the extensions, and Python's own message blames a circular import."""

from __future__ import annotations

import os

try:
    from infinity import _adam, _aio
except ImportError as e:
    here = os.path.dirname(os.path.abspath(__file__))
    raise ImportError(
        f"infinity's compiled extensions (_aio, _adam) are not in {here}: this looks like a source checkout "
        "that shadows the installed package (Python imports the directory it runs in first). Run from another "
        "directory to use the installed infinity, or build this checkout in place with "
        "`pip install torch==2.13.0 -e .`") from e

__all__ = ["_adam", "_aio"]
