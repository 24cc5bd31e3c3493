"""Page bookkeeping for the paged KV pool: who holds which page, and prefix sharing.

No torch here: pages are integers, and the tensors they index live in
`paged_attention.KVPool`. A request holds the pages its tokens occupy, in order; a page
may be held by several requests when they begin with the same tokens.

Prefix sharing works on whole pages, keyed by a chain hash: page i's key is
blake2b(key of page i-1, the page's token ids), so equal keys mean equal prefixes, not
just equal pages. A page is *registered* under its key when its writer takes it (the
request that will compute it), and *ready* once its keys and values are in the pool.
A request that finds the next page of its prefix registered but not ready waits for it
instead of computing it again: that is how the `num_repeat` requests of a GRPO group,
which arrive together with one prompt, compute the prompt once. A page nobody holds any
more stays registered (a multi-turn episode's next call finds its earlier turns) until
its memory is needed: free pages are handed out first, then the least recently released
registered ones. `reset()` after a weight update forgets every key: no keys or values
computed with old weights are read again.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PagePool", "PrefixMatch", "page_keys"]


def page_keys(tokens: Sequence[int], page_size: int, *, start: int = 0,
              previous: bytes = b"") -> list[bytes]:
    """Chain keys of the whole pages of `tokens` from page `start` on (`previous` is the
    key of page `start - 1`)."""
    keys: list[bytes] = []
    key = previous
    for first in range(start * page_size, len(tokens) - page_size + 1, page_size):
        page = array("q", tokens[first:first + page_size]).tobytes()
        key = hashlib.blake2b(key + page, digest_size=16).digest()
        keys.append(key)
    return keys


@dataclass(frozen=True)
class PrefixMatch:
    """What `PagePool.match` found for a prefix."""

    #: ready pages, in order, that the request may take (not yet held by it)
    pages: list[int]
    #: the next page is registered but still being computed: wait for it
    wait: bool


class PagePool:
    """Pages 0 .. pages-1, with reference counts and the prefix table."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.reset()

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now."""
        return len(self._free) + len(self._idle)

    def match(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The longest ready prefix of `keys`, and whether a page being computed follows."""
        pages: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                return PrefixMatch(pages, wait=False)
            if page not in self._ready:
                return PrefixMatch(pages, wait=True)
            pages.append(page)
        return PrefixMatch(pages, wait=False)

    def hold(self, pages: Sequence[int]) -> None:
        """Take a reference on pages found by `match`."""
        for page in pages:
            if self._refs[page] == 0:
                self._idle.pop(page, None)
            self._refs[page] += 1

    def allocate(self, count: int) -> list[int] | None:
        """`count` pages for one writer, or None (nothing taken) when too few are left."""
        if count > self.available:
            return None
        taken = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:  # evict the least recently used idle prefix page
                page, _ = self._idle.popitem(last=False)
                self._forget(page)
            self._refs[page] = 1
            taken.append(page)
        return taken

    def register(self, page: int, key: bytes, *, ready: bool) -> None:
        """File a held page under `key` (first writer wins: a key stays with its page)."""
        if key in self._page_of or page in self._key_of:
            return
        self._key_of[page] = key
        self._page_of[key] = page
        if ready:
            self._ready.add(page)

    def mark_ready(self, page: int) -> None:
        if page in self._key_of:
            self._ready.add(page)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page; pages nobody holds become reusable. A page
        released before it was ready is forgotten (its writer will never finish it)."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._ready:
                self._idle[page] = None
            else:
                self._forget(page)
                self._free.append(page)

    def reset(self) -> None:
        """Forget every key and free every page (callers hold none any more)."""
        self._refs = [0] * self.pages
        self._free = list(range(self.pages - 1, -1, -1))  # a stack: low pages first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._ready: set[int] = set()
        #: registered pages nobody holds, least recently released first
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
        self._ready.discard(page)
