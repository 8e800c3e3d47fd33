"""A request's record: its phase changes only along `MOVES` (an illegal move raises and changes
nothing), through the state's own allocation and release paths; its setting is parsed once while
it waits."""

import pytest
import torch

from sglang_kvsparse.config.request_sparsity import RequestSparsity
from sglang_kvsparse.state.entry_table import HeapError
from sglang_kvsparse.state.requests import MOVES, Phase, PhaseError, Requests

from .heap import grow, make_state


def test_every_phase_is_reachable_only_from_its_listed_phases() -> None:
    for to, sources in MOVES.items():
        for start in Phase:
            requests = Requests(4)
            requests.phase[2] = int(start)
            if start in sources:
                requests.move(torch.tensor([2]), to)
                assert requests.phase[2] == to
            else:
                with pytest.raises(PhaseError, match=f"cannot move to {to.name}.*2 {start.name}"):
                    requests.move(torch.tensor([2]), to)
                assert requests.phase[2] == start


def test_an_illegal_move_in_a_batch_changes_no_request() -> None:
    requests = Requests(4)
    requests.phase[torch.tensor([1, 2])] = torch.tensor([Phase.PREFILLING, Phase.ADMITTED], dtype=torch.int8)
    with pytest.raises(PhaseError, match="2 ADMITTED"):
        requests.move(torch.tensor([1, 2]), Phase.DECODING)  # 2 has not been allocated yet
    assert requests.phase[[1, 2]].tolist() == [Phase.PREFILLING, Phase.ADMITTED]


def test_a_request_moves_through_its_life_by_the_states_own_paths() -> None:
    state, _ = make_state(context=64, budget=8, evict_page=4, rows=512)
    phase = lambda: Phase(int(state.requests.phase[1]))  # noqa: E731
    assert phase() == Phase.FREE
    state.expect([1], [30], [12])
    assert phase() == Phase.ADMITTED
    grow(state, [1], [12])
    assert phase() == Phase.PREFILLING  # allocated; its prefill has not run
    state.begin_extend([1], [0], [12])
    state.finish_forward()
    assert phase() == Phase.PREFILLING  # planning a forward is not running it
    grow(state, [1], [13])
    assert phase() == Phase.DECODING  # its first decode token: the prefill ran
    state.free(1)
    assert phase() == Phase.FREE


def test_allocating_a_request_never_admitted_raises_and_changes_nothing() -> None:
    state, heap = make_state(context=64, budget=8, rows=512)
    free = heap.free_rows()
    with pytest.raises(HeapError, match="never admitted"):
        state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor([3]), target_seq_lens_cpu=torch.tensor([5]))
    assert heap.free_rows() == free and state.requests.phase[3] == Phase.FREE


def test_a_waiting_requests_setting_is_parsed_once_and_forgotten_when_no_longer_asked_for() -> None:
    requests = Requests(2)
    parsed = []

    def parse(budget: int):
        def run() -> RequestSparsity:
            parsed.append(budget)
            return RequestSparsity(budget=budget)

        return run

    first = requests.arrive("a", parse(64))
    assert requests.arrive("a", parse(99)) is first and parsed == [64]  # asked again: not parsed again
    requests.new_round()
    assert requests.arrive("a", parse(99)) is first  # still waiting in the next round
    requests.new_round()
    requests.new_round()  # a whole round without it: it left the queue (admitted or aborted)
    assert requests.arrive("a", parse(32)).budget == 32 and parsed == [64, 32]
