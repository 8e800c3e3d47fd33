"""EntryTable: each request's entries' heap rows in one group, page by page and column by column."""

import pytest
import torch

from sglang_kvsparse.state.entry_table import EntryTable, HeapError


def pages(*starts: int, page: int = 2) -> torch.Tensor:
    """Rows of whole pages starting at `starts` (page-major, as the heap hands them out)."""
    return torch.cat([torch.arange(s, s + page) for s in starts])


def test_assign_lays_pages_out_by_position_and_column():
    table = EntryTable(max_requests=4, max_entries=6, columns=2, page_size=2)
    assert table.pages_for(3) == 4  # 2 pages per column
    table.assign(1, 3, pages(10, 20, 30, 40))  # position page 0: cols (10, 20); page 1: (30, 40)
    assert table.entries(1).tolist() == [[10, 20], [11, 21], [30, 40]]
    assert table.count(1) == 3 and table.rows_held() == 8
    with pytest.raises(HeapError, match="already"):
        table.assign(1, 1, pages(50, 60))
    with pytest.raises(HeapError, match="needs"):
        table.assign(2, 3, pages(50, 60))


def test_append_takes_a_page_only_at_page_boundaries():
    table = EntryTable(max_requests=4, max_entries=8, columns=2, page_size=2)
    table.assign(1, 3, pages(10, 20, 30, 40))
    table.assign(2, 2, pages(50, 60))
    req_indices = torch.tensor([1, 2])
    assert table.needing_page(req_indices).tolist() == [2]
    table.append(req_indices, pages(70, 80))
    assert table.last_entries(req_indices).tolist() == [[31, 41], [70, 80]]
    with pytest.raises(HeapError, match="needs"):
        table.append(req_indices, torch.empty(0, dtype=torch.int64))  # both requests need a page now
    with pytest.raises(HeapError, match="twice"):
        table.append(torch.tensor([1, 1]), torch.empty(0, dtype=torch.int64))


def test_shrink_and_release_return_whole_pages():
    table = EntryTable(max_requests=4, max_entries=8, columns=2, page_size=2)
    table.assign(1, 6, pages(10, 20, 30, 40, 50, 60))
    freed = table.shrink(1, 3)  # keeps 2 pages per column
    assert sorted(freed.tolist()) == [50, 51, 60, 61] and table.count(1) == 3
    assert sorted(table.release(1).tolist()) == [10, 11, 20, 21, 30, 31, 40, 41]
    assert not table.is_active(1) and table.rows_held() == 0
    with pytest.raises(HeapError, match="holds no entries"):
        table.release(1)


def test_a_full_request_must_evict_before_it_appends():
    table = EntryTable(max_requests=2, max_entries=2, columns=1, page_size=1)
    table.assign(1, 2, torch.tensor([5, 6]))
    with pytest.raises(HeapError, match="full request"):
        table.append(torch.tensor([1]), torch.tensor([7]))
