"""Jobs called from inside an asyncio event loop (a Jupyter cell).

Jupyter runs every cell inside an event loop, where Serve's blocking handle calls
(`DeploymentResponse.result()`) refuse to run. A job function wrapped here runs in a
worker thread there while the cell waits; from a script it runs as is.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor


def off_event_loop(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fn(*args, **kwargs)
        with ThreadPoolExecutor(1, thread_name_prefix=fn.__name__) as pool:
            return pool.submit(fn, *args, **kwargs).result()
    return wrapper
