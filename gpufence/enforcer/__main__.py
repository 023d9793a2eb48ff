"""``python -m gpufence.enforcer``: same as ``gpufence-enforcer``."""

import sys

from gpufence.enforcer.cli import main

sys.exit(main())
