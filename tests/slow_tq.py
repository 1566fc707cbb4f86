"""`python tests/slow_tq.py ARGS...`: the `tq` command line with a pause after every
finished tensor, so a test can kill or race a conversion mid-way. The library itself has
no test hook; this wraps the converter's stream from outside."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from tq_cli.app import main
from tq_cli.conversion import converter

DELAY = 0.3  # seconds after each finished tensor
_stream = converter.stream


def _slow_stream(*args: Any, **kwargs: Any) -> Iterator[Any]:
    for finished in _stream(*args, **kwargs):
        yield finished
        time.sleep(DELAY)


converter.stream = _slow_stream  # type: ignore[assignment]

if __name__ == "__main__":
    sys.argv[0] = "tq"
    main()
