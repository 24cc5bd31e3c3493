"""`HeaderTimeoutProtocol`: uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but it has no
limit for a request whose headers never finish: a connection that opens and sends
nothing, or sends one header byte a second (slowloris), was held open for good, and 50
of them stayed open as long as their clients liked. This subclass arms a timer when a
connection opens and when the first bytes of a request's head arrive; the timer is not
reset by later bytes, so trickling does not help. If the request line and headers are
not complete within `header_timeout_s` (`AJET_SWARM_HEADER_TIMEOUT_S`), the connection
gets a 408 (if it sent anything) and is closed. Once a request's headers are in, the
body has its own idle limit (`request_body_timeout_s`, `swarm_server.limits`), and
between requests uvicorn's keep-alive timeout applies as before.

`ajet-swarm start` runs uvicorn with this class as its `http` protocol (h11 always; the
server does not depend on httptools), so its command line and options are unchanged.
"""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeaderTimeoutProtocol", "with_header_timeout"]


class HeaderTimeoutProtocol(H11Protocol):
    """See the module docstring. `header_timeout_s` is set per server by `with_header_timeout`."""

    header_timeout_s: ClassVar[float] = 10.0

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request's head
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm()  # part of the next request's head is already buffered

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ timer

    def _follow(self) -> None:
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:
            self._arm()  # a request's head has begun and is not complete
        else:
            self._disarm()  # headers complete: the body and the route take over

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # it sent part of a request: say why it is cut
            body = json.dumps({
                "detail": f"request headers not complete within {self.header_timeout_s:g} s",
                "hint": "send the request line and headers at once "
                        "(AJET_SWARM_HEADER_TIMEOUT_S on the server)"}).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)
        self.transport.close()


def with_header_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass to `uvicorn.run(http=...)` for this deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout_s": timeout_s})
