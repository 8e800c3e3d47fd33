"""What the sparse layers' state has done since start-up, for `/kvsparse/stats` (`stats.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    """What the state has done since start-up (for stats)."""

    forward_plans: int = 0
    evictions: int = 0  # (request, group) evictions handed to decode forwards
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    chunks_stored: int = 0  # prefill chunks before a prompt's last, kept whole in the store
    store_entries_adopted: int = 0  # store entries moved to the tree's id for the same token
    #: Allocations that waited for SGLang's frees to reach the host (memory was short at once).
    release_waits: int = 0
    requests_running_peak: int = 0
    #: Device values the sparse path read back (each a host wait on a GPU): request indices SGLang
    #: gave a forward no host copy of.
    host_syncs: int = 0
    #: Copies of SGLang's free ids to the host made while allocating a decode step (the host
    #: free list ran short of the running requests' reserve: memory pressure).
    decode_refills: int = 0
    #: Admissions put off because the request's own setting would have made one more than
    #: `max_distinct_settings` among the running requests (it waits for one of them to finish).
    setting_waits: int = 0
    #: The most scoring passes one prefill forward made (one per policy among its requests),
    #: and the most evictions one decode step ran (one per group and (budget, policy)).
    scoring_passes_peak: int = 0
    evictions_per_step_peak: int = 0
    #: The most heap rows a guided prefill's new tokens waited in during one forward, and the
    #: admissions put off to the next round because this round's guided prefills held rows that
    #: come back after their forward.
    guide_rows_peak: int = 0
    guide_waits: int = 0
    #: Requests given rows, by their setting's label (`RequestSparsity.label`); a retracted
    #: request counts again when it is readmitted.
    requests_by_setting: dict[str, int] = field(default_factory=dict)

    def add(self, **amounts: int) -> None:
        """Count these events (field name -> how many more)."""
        for name, amount in amounts.items():
            setattr(self, name, getattr(self, name) + amount)

    def peak(self, **values: int) -> None:
        """Keep the largest value seen of these peaks (field name -> this time's value)."""
        for name, value in values.items():
            setattr(self, name, max(getattr(self, name), value))

    def count_setting(self, label: str) -> None:
        """One more request given rows with the setting of this label."""
        self.requests_by_setting[label] = self.requests_by_setting.get(label, 0) + 1
