"""``python -m gpufence.certs`` == ``gpufence-certs``."""

import sys

from gpufence.certs.cli import main

sys.exit(main())
