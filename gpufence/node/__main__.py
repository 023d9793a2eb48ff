"""python -m gpufence.node"""

import sys

from gpufence.node.cli import main

sys.exit(main())
