"""A transport wrapper that sends a response's head and body in one `write`.

uvicorn writes a response's head when the app starts it and its body when it is sent:
two writes, and the peer often wakes twice, reading the reply in two pieces (the swarm
server read about every other engine chat reply that way). Both uvicorn servers of this
project, the swarm server's public one and the engine's private channel, wrap their
connections' transports in `CoalescedWrites`. Standard library only: the laptop side
and the engine import it as cheaply as the server.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["CoalescedWrites"]


class CoalescedWrites:
    """A transport whose writes within one turn of the event loop go out as one `write`.

    Everything else is the wrapped transport's; `close` and `write_eof` send what is
    pending first, `abort` drops it. The delay is to the end of the current turn (the
    app's head and body messages are sent without yielding in between), never a timer.
    """

    __slots__ = ("_loop", "_pending", "_transport", "is_closing", "pause_reading",
                 "resume_reading")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        # called on every request: bound here rather than found by `__getattr__` each time
        self.is_closing = transport.is_closing
        self.pause_reading = transport.pause_reading
        self.resume_reading = transport.resume_reading

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def get_write_buffer_size(self) -> int:
        return int(self._transport.get_write_buffer_size()) + sum(map(len, self._pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def _flush(self) -> None:
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
