"""Streamed answers: several choices' chunks merged as they come, sent as server-sent events as the openai SDK
reads them (`data: {json}`, then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from trtglm.openai_api.errors import ApiError

log = logging.getLogger(__name__)


async def merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of several async iterators as they come; the first error ends all of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        finished = 0
        while finished < len(tasks):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is done:
                finished += 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def after(first: dict | None, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """`first` (None: nothing), then the rest: a stream whose first chunk was awaited before the response began."""
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events as the openai SDK reads them; an error after the first chunk is sent as an event."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
    except ApiError as e:
        yield f"data: {json.dumps(e.body(), ensure_ascii=False)}\n\n".encode()
    except Exception as e:  # the response has started: the client learns of it in the stream
        log.error("unexpected error while streaming", exc_info=e)
        body = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").body()
        yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"
