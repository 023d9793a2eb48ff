"""``python -m bench.reuse_port_webhook ARGS``: ``gpufence-webhook ARGS`` with SO_REUSEPORT on its
listening socket, so that several such processes share one port and the kernel spreads the
connections over them. A benchmark's experiment (bench.pod_creation ``--processes``), not a way to
ship the webhook: each process runs its own watches of the API server."""

from __future__ import annotations

import asyncio
import functools
import sys
from typing import Any

from gpufence.webhook.cli import main


def _with_reuse_port(create_server: Any) -> Any:
    @functools.wraps(create_server)
    async def wrapped(self: asyncio.AbstractEventLoop, *args: Any, **kwargs: Any) -> Any:
        kwargs["reuse_port"] = True
        return await create_server(self, *args, **kwargs)
    return wrapped


if __name__ == "__main__":
    asyncio.BaseEventLoop.create_server = _with_reuse_port(asyncio.BaseEventLoop.create_server)  # type: ignore[method-assign]
    sys.exit(main())
