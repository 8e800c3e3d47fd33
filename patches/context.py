"""What the patches of one scheduler process share, reached one way: the sparse state, and the
admission round in progress.

SGLang runs one scheduler (and, at TP=1, one model runner) per process. `patches/memory.py`
builds the `SparseState` while SGLang builds its pools and installs it here; the attention
backend, admission, the prefix cap and the stats read it from here. The admission round
(`AdmissionRound`) is the project's record of one of SGLang's `PrefillAdder`s (one per
scheduling round), kept here rather than on SGLang's objects; the heap allocator reads the charge
of the prefill SGLang is sizing from it. A leaf module (it imports no other patch), so the
patches never import each other in a circle.
"""

from __future__ import annotations

import weakref
from typing import Any

from sglang_kvsparse.state.admission import AdmissionRound
from sglang_kvsparse.state.sparse_state import SparseState

_state: SparseState | None = None
#: The round in progress, with the `PrefillAdder` it belongs to (weakly: SGLang drops it).
_round: tuple[weakref.ref[Any], AdmissionRound] | None = None


def install(state: SparseState) -> None:
    global _state
    _state = state


def current() -> SparseState | None:
    """The state, or None in a process that has none (stock SGLang, or pools not built yet)."""
    return _state


def state() -> SparseState:
    """The state; raises if this process has none (a hook ran where no sparse pools were built)."""
    if _state is None:
        raise RuntimeError("kvsparse: no sparse state in this process (the KV pools were built without the plugin)")
    return _state


def admission_round(adder: Any) -> AdmissionRound | None:
    """The round of this `PrefillAdder`, None before its first admission call."""
    if _round is not None and _round[0]() is adder:
        return _round[1]
    return None


def start_round(adder: Any, round_: AdmissionRound) -> None:
    """`round_` is the round of `adder` from now on (the previous round is over)."""
    global _round
    _round = (weakref.ref(adder), round_)


def prefill_charge(prefill_tokens: int) -> int:
    """Sparse rows of the prefill SGLang is sizing now, by the prefill's end (prefix + extend
    tokens): 0 outside an admission decision (`patches/admission.charging`)."""
    charge = None if _round is None else _round[1].charge
    return charge(prefill_tokens) if charge is not None else 0
