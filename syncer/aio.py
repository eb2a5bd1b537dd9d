"""asyncio helpers."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Iterable, TypeVar

T = TypeVar("T")


async def gather_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``asyncio.gather`` but the first failure cancels the others (no wasted
    downloads or uploads after a corrupt chunk) and is raised as itself."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed.exception()
    return [t.result() for t in tasks]
