"""The paged pool's bookkeeping: allocation, prefix sharing, waiting on a prefix, reuse."""

from __future__ import annotations

from ajet.engine.generation.page_pool import PagePool, page_keys

PAGE = 4


def test_keys_chain_the_whole_prefix_and_continue_from_a_page() -> None:
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], PAGE)
    assert len(a) == 2  # whole pages only
    b = page_keys([9, 9, 9, 9, 5, 6, 7, 8], PAGE)
    assert a[1] != b[1]  # the same page after a different prefix is another key
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], PAGE, start=1, previous=a[0]) == a[1:]


def test_a_prefix_is_shared_once_ready_and_waited_for_while_it_is_computed() -> None:
    pool = PagePool(8)
    keys = page_keys(list(range(12)), PAGE)
    writer = pool.allocate(3)
    assert writer is not None and pool.available == 5
    for page, key in zip(writer, keys, strict=True):
        pool.register(page, key, ready=False)
    assert pool.match(keys).wait and pool.match(keys).pages == []
    pool.mark_ready(writer[0])
    match = pool.match(keys)
    assert match.pages == [writer[0]] and match.wait
    for page in writer[1:]:
        pool.mark_ready(page)
    match = pool.match(keys)
    assert match.pages == writer and not match.wait
    pool.hold(match.pages)
    pool.release(writer)  # the writer is done; the reader still holds them
    assert pool.available == 5
    pool.release(match.pages)  # nobody holds them: idle, still found by their keys
    assert pool.available == 8 and pool.match(keys).pages == writer


def test_a_writer_released_before_its_pages_were_ready_leaves_no_key_behind() -> None:
    pool = PagePool(4)
    keys = page_keys(list(range(8)), PAGE)
    pages = pool.allocate(2)
    assert pages is not None
    for page, key in zip(pages, keys, strict=True):
        pool.register(page, key, ready=False)
    pool.release(pages)  # cancelled mid-prefill
    match = pool.match(keys)
    assert match.pages == [] and not match.wait and pool.available == 4


def test_free_pages_go_first_then_the_least_recently_released_prefix() -> None:
    pool = PagePool(3)
    first, second = page_keys([1] * 4, PAGE), page_keys([2] * 4, PAGE)
    for keys in (first, second):
        pages = pool.allocate(1)
        assert pages is not None
        pool.register(pages[0], keys[0], ready=True)
        pool.release(pages)
    assert pool.allocate(4) is None  # all or nothing
    taken = pool.allocate(2)  # the free page, then the older idle prefix page
    assert taken is not None and pool.match(first).pages == [] and pool.match(second).pages
    pool.reset()  # after a weight update nothing is found again
    assert pool.available == 3 and pool.match(second).pages == []
