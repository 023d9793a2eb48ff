"""``python -m enforcer``: same as ``gpufence-enforcer``."""

import sys

from enforcer.cli import main

sys.exit(main())
