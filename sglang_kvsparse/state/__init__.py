"""The sparse layers' state in one scheduler process, and the one KV heap it draws rows from.

Contract: `SparseState` (`sparse_state.py`) is what SGLang's request-to-token pool keeps in step
with its requests (the `AuxCache` of `contracts.py`): it owns each request's record
(`requests.py`: lengths, setting, phase), each group of sparse columns' entry and score tables
(`sparse_group.py`, `entry_table.py`), the prefix store (`prefix_store.py`, with SGLang's frees on
their way to it, `released_ids.py`) and the `Heap` (`heap.py`) through which all of them take and
give heap rows; `layout.py` says what a request of a length holds, `admission.py` what admission
and SGLang's decode check charge for it. State lives on the host; nothing here imports SGLang or
reads a device value back.
"""
