"""Request rate limits per API key: a fixed window per minute, in Redis when there is one.

With several worker processes the count must be shared, or each worker would allow the limit
again: with a Redis URL each request is one ``INCR`` (and an ``EXPIRE`` on the window's first)
of a key named after the window. Without, the count lives in this process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from typing import Any

__all__ = ["RateLimiter"]

_WINDOW_S = 60.0


class RateLimiter:
    """At most ``per_minute`` requests per key and minute.

    Args:
        per_minute: requests one key may make in a minute.
        redis_url: share the counts through this Redis (all workers see one count).
        clock: seconds since the epoch (tests pass their own).
    """

    def __init__(
        self,
        per_minute: int,
        *,
        redis_url: str | None = None,
        clock: Any = time.time,
    ) -> None:
        if per_minute < 1:
            raise ValueError("per_minute must be >= 1")
        self.per_minute = per_minute
        self.clock = clock
        self._redis_url = redis_url
        self._redis: Any = None
        self._redis_loop: asyncio.AbstractEventLoop | None = None
        self._counts: OrderedDict[tuple[str, int], int] = OrderedDict()

    async def check(self, key: str) -> float | None:
        """Count one request of ``key``: None when it may go on, else the seconds to wait."""
        now = float(self.clock())
        window = int(now // _WINDOW_S)
        count = await self._increment(key, window)
        if count <= self.per_minute:
            return None
        return max(1.0, math.ceil((window + 1) * _WINDOW_S - now))

    async def _increment(self, key: str, window: int) -> int:
        if self._redis_url is None:
            name = (key, window)
            self._counts[name] = self._counts.get(name, 0) + 1
            self._counts.move_to_end(name)
            while len(self._counts) > 100_000:
                self._counts.popitem(last=False)
            return self._counts[name]
        client = await self._client()
        redis_key = f"keel:rate:{key}:{window}"
        async with client.pipeline(transaction=True) as pipe:
            pipe.incr(redis_key)
            pipe.expire(redis_key, int(_WINDOW_S * 2))
            count, _ = await pipe.execute()
        return int(count)

    async def _client(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._redis is None or self._redis_loop is not loop:
            # redis+cluster:// gets the cluster-aware client: the window's one key is on one
            # slot, so its INCR and EXPIRE stay one transaction there.
            from keel.stores._redis_client import async_redis_client

            self._redis = async_redis_client(str(self._redis_url))
            self._redis_loop = loop
        return self._redis

    async def aclose(self) -> None:
        """Close the Redis client, if one was opened."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
