"""A fault in the sparse layers' per-request scheduler work fails that request, not the server.

SGLang runs prefix matching and admission in its scheduler's event loop, where an exception ends
the scheduler process and with it every request. The sparse layers' work there that belongs to
one request (capping its radix match at the prefix store, pinning its prefix's store blocks,
the admission checks) runs inside `request_guard`: an exception is logged with its traceback and
the request is finished with an error its client sees (HTTP 500, `InternalServerError`), through
SGLang's own abort of a queued request (`Req.set_finish_with_abort`, which also cuts its prompt to
one token). The request then sits out the current admission round (`sits_out`) and is admitted
in the next one as a one-token prefill that retires it; the other requests carry on.

Work on a whole batch (the forward's plan, evictions, the layers) is not guarded: a fault there
leaves the heap's tables in an unknown state, and stopping is safer than serving from them.

Fault injection, for tests (`SGLANG_KVSPARSE_FAULT=<point>:<rid prefix>[,...]`): requests whose
rid starts with the prefix raise `InjectedFault` at that point (`match` or `admission`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

FAULT_ENV = "SGLANG_KVSPARSE_FAULT"
POINTS = ("match", "admission")
#: The rids of requests failed in this round (kept here: nothing is stored on SGLang's objects).
_failed: set[str] = set()

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised on purpose by `inject` (tests)."""


def inject(point: str, req: Any) -> None:
    """Raise at `point` for a request the fault-injection variable names."""
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        where, _, prefix = spec.partition(":")
        if where not in POINTS or not prefix:
            raise ValueError(f"{FAULT_ENV}: {spec!r} is not <point>:<rid prefix> with a point of {POINTS}")
        if where == point and str(req.rid).startswith(prefix):
            raise InjectedFault(f"fault injected at {point} for request {req.rid}")


@contextmanager
def request_guard(req: Any, where: str) -> Iterator[None]:
    """Run one request's sparse work; on an exception fail that request (see the module doc)."""
    try:
        yield
    except Exception as exc:
        logger.exception("kvsparse: %s failed for request %s; failing the request", where, req.rid)
        req.set_finish_with_abort(
            f"kvsparse: internal error in the sparse layers' {where}: {type(exc).__name__}: {exc}",
            status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            err_type="InternalServerError",
        )
        _failed.add(req.rid)


def sits_out(req: Any) -> bool:
    """True once for a request that failed this round: its next round matches its one-token prompt."""
    if req.rid in _failed:
        _failed.discard(req.rid)
        return True
    return False
