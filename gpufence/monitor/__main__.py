import sys

from gpufence.monitor.cli import main

sys.exit(main())
