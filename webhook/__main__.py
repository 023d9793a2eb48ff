"""``python -m webhook``: the same as ``gpufence-webhook``."""

from webhook.cli import main

raise SystemExit(main())
