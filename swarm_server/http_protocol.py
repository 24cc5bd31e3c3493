"""uvicorn's HTTP protocols with a deadline and a size bound for request headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but it has no
limit for a request whose headers never finish: a connection that opens and sends
nothing, or sends one header byte a second (slowloris), was held open for good, and 50
of them stayed open as long as their clients liked. These subclasses arm a timer when a
connection opens and when the first bytes of a request's head arrive; the timer is not
reset by later bytes, so trickling does not help. If the request line and headers are
not complete within `header_timeout_s` (`AJET_SWARM_HEADER_TIMEOUT_S`), the connection
gets a 408 (if it sent anything) and is closed. Once a request's headers are in, the
body has its own idle limit (`request_body_timeout_s`, `swarm_server.limits`), and
between requests uvicorn's keep-alive timeout applies as before.

Two parsers, one behaviour (`with_header_timeout` picks):

- `HttpToolsHeaderTimeoutProtocol` over uvicorn's httptools protocol (llhttp, C), the
  default: parsing a request costs a few microseconds instead of h11's hundred-odd, a
  large share of the episode plane's CPU per call. llhttp has no bound of its
  own on the request line and headers (httptools buffers a header it has not seen the
  end of), so this class counts the bytes of an unfinished head and answers 431 and
  closes once they pass `max_header_bytes`;
- `HeaderTimeoutProtocol` over uvicorn's h11 protocol, where httptools is not installed;
  h11 bounds the head itself (`h11_max_incomplete_event_size`, set by `ajet-swarm start`).

`swarm_server.limits` checks the same header bound again on the parsed request, whatever
parser ran.

Both also write a response's head and body in one `write` (`ajet.coalesced_writes`): uvicorn
writes the head as soon as the app starts the response and the body when it is sent,
two segments and two wake-ups of the client for every small JSON answer of the episode
plane. Writes made within one turn of the event loop go out together at its end.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ajet.coalesced_writes import CoalescedWrites

__all__ = ["HeaderTimeoutProtocol", "HttpToolsHeaderTimeoutProtocol", "httptools_available",
           "with_header_timeout"]


def httptools_available() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


def _refusal(status: bytes, detail: str, hint: str) -> bytes:
    body = json.dumps({"detail": detail, "hint": hint}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _HeaderDeadline:
    """The timer both protocols share; each says where its parser is."""

    header_timeout_s: ClassVar[float] = 10.0
    max_header_bytes: ClassVar[int] = 64 * 1024

    _header_timer: asyncio.TimerHandle | None = None
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def _head_unfinished(self) -> bool:
        """A request's head has begun and is not complete."""
        raise NotImplementedError

    def _request_in_flight(self) -> bool:
        """A request's head is complete and its response is not."""
        raise NotImplementedError

    def _follow(self) -> None:
        if self.transport.is_closing():
            self._disarm()
        elif self._head_unfinished():
            self._arm()
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
        if self.transport.is_closing() or self._request_in_flight():
            return
        if self._head_unfinished():  # it sent part of a request: say why it is cut
            self.transport.write(_refusal(
                b"408 Request Timeout",
                f"request headers not complete within {self.header_timeout_s:g} s",
                "send the request line and headers at once (AJET_SWARM_HEADER_TIMEOUT_S on "
                "the server)"))
        self.transport.close()


class HeaderTimeoutProtocol(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol with the header deadline (see the module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescedWrites(transport, self.loop)  # type: ignore[assignment]
        self._arm()  # a connection that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request's head
        if self._head_unfinished():
            self._arm()  # part of the next request's head is already buffered

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_unfinished(self) -> bool:
        return self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])

    def _request_in_flight(self) -> bool:
        return self.conn.their_state is not h11.IDLE


def _httptools_base() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


if httptools_available():
    _HttpToolsBase = _httptools_base()
else:  # the class below is never used then (`with_header_timeout` picks h11)
    _HttpToolsBase = asyncio.Protocol


class HttpToolsHeaderTimeoutProtocol(_HeaderDeadline, _HttpToolsBase):  # type: ignore[misc,valid-type]
    """uvicorn's httptools protocol with the header deadline and the header byte bound."""

    _in_head = False
    _head_bytes = 0
    _head_too_large = False
    #: paths whose requests are not written to uvicorn's access log (`with_header_timeout`)
    quiet_paths: ClassVar[frozenset[str]] = frozenset()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescedWrites(transport, self.loop)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # an upper bound of the unfinished head: every chunk that ended inside it
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_large_head()
                return
            self._arm()  # `_follow`, for the case at hand
        else:
            self._head_bytes = 0
            if self._header_timer is not None:
                self._disarm()  # headers complete (or closing): the body and route take over

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        cycle = self.cycle
        if (self.quiet_paths and cycle is not None and cycle.scope is self.scope
                and self.scope.get("path") in self.quiet_paths):
            cycle.access_log = False

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            return  # already answered 431
        super().send_400_response(msg)

    def _refuse_large_head(self) -> None:
        self._head_too_large = True
        self._disarm()
        self.transport.write(_refusal(
            b"431 Request Header Fields Too Large",
            f"request headers of more than {self.max_header_bytes} bytes",
            "send fewer or shorter headers, or raise AJET_SWARM_MAX_HEADER_BYTES"))
        self.transport.close()

    def _head_unfinished(self) -> bool:
        return self._in_head

    def _request_in_flight(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete


def with_header_timeout(timeout_s: float, *, max_header_bytes: int = 64 * 1024,
                        parser: str = "auto", quiet_paths: frozenset[str] = frozenset()
                        ) -> type[asyncio.Protocol]:
    """The protocol class to pass to `uvicorn.run(http=...)`: httptools when installed
    (`parser="auto"`), else h11; `parser="h11"` or `"httptools"` to choose.

    With httptools, requests to `quiet_paths` (the episode plane's per-call routes) are
    not written to uvicorn's access log: a line per call of every rollout worker floods
    it, and writing it is a measurable part of the call's CPU (its arguments are
    formatted even when the log level drops it)."""
    if parser == "httptools" and not httptools_available():
        raise RuntimeError("AJET_SWARM_HTTP_PARSER=httptools, but httptools is not installed")
    use_httptools = parser == "httptools" or (parser == "auto" and httptools_available())
    base: type[_HeaderDeadline] = (HttpToolsHeaderTimeoutProtocol if use_httptools
                                   else HeaderTimeoutProtocol)
    return type(base.__name__, (base,), {"header_timeout_s": timeout_s,
                                         "max_header_bytes": max_header_bytes,
                                         "quiet_paths": frozenset(quiet_paths)})
