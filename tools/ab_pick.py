"""The environment of the fastest variant of a ``tools/ab_decode.py`` run, as shell ``export`` lines, for a bench in
the same device call to run with it (its graph time at the smallest batch size measured, best of its rounds).

    python tools/ab_pick.py OUT/ab-decode-*.json > OUT/picked.env && . OUT/picked.env
"""

from __future__ import annotations

import json
import shlex
import sys


def pick(result: dict) -> tuple[str, dict]:
    """(name, environment) of the variant whose first row (smallest batch) has the lowest graph time; variants
    that leave pieces out (``HYLO_ABLATE``: what-if timing, wrong outputs) are never picked."""
    best = {n: rows for n, rows in result["best"].items() if "HYLO_ABLATE" not in result["variants"][n]}
    if not best:
        raise ValueError("the A/B run holds no measured variant")
    name = min(best, key=lambda n: best[n][0]["graph_ms"])
    return name, result["variants"][name]


def main() -> None:
    with open(sys.argv[1]) as f:
        name, env = pick(json.load(f))
    print(f"# fastest variant: {name}")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


if __name__ == "__main__":
    main()
