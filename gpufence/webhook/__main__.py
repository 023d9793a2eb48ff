"""``python -m gpufence.webhook``: the same as ``gpufence-webhook``."""

from gpufence.webhook.cli import main

raise SystemExit(main())
