"""Dead code in gpufence/: `make lint` fails while vulture finds a name nothing uses.

The package is checked; the tests, benchmarks and scripts count as users (a test seam such as
``Throttle.stopped_targets`` is not dead). Names used only by name or reflection (ctypes fields,
callbacks a library calls) are listed in scripts/dead_code_allowlist.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import vulture

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ROOT / "gpufence"
USERS = ("tests", "bench", "scripts")
MIN_CONFIDENCE = 60  # vulture's lowest: unused functions, classes, attributes and variables too


def main() -> int:
    finder = vulture.Vulture()
    finder.scavenge([str(CHECKED), *(str(ROOT / user) for user in USERS)])
    dead = [item for item in finder.get_unused_code(min_confidence=MIN_CONFIDENCE)
            if Path(item.filename).resolve().is_relative_to(CHECKED)]
    for item in dead:
        print(item.get_report(), file=sys.stderr)
    if dead:
        print(f"{len(dead)} unused in gpufence/: remove it, or list it in scripts/dead_code_allowlist.py "
              "with the reason it is used by name", file=sys.stderr)
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
