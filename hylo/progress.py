"""Progress of long work (loading layers, capturing graphs, generating a batch): a live bar on a terminal, and on a
log (stderr not a terminal) a few whole lines instead of carriage-return updates that run into the log's lines."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator


def progress(items: Iterable, desc: str, enabled: bool = True, unit: str = "it", total: int | None = None) -> Iterator:
    """Yield ``items``, reporting progress to stderr when ``enabled``."""
    if not enabled:
        yield from items
        return
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        yield from tqdm(items, desc=desc, unit=unit, total=total, leave=False)
        return
    items = list(items) if total is None else items
    total = len(items) if total is None else total
    t0, quarter = time.perf_counter(), max(total // 4, 1)
    for i, item in enumerate(items):
        yield item
        done = i + 1
        if done == total or (total >= 8 and done % quarter == 0):
            print(f"[hylo] {desc}: {done}/{total} {unit} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr,
                  flush=True)
