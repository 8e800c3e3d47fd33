"""One forward of the sparse layers: planned once per step from the state, then run layer by layer.

Contract: `SparseForward` (`sparse_forward.py`) is the sparse side of SGLang's attention backend:
the patches hand it a forward's plain values and it changes the state for the step
(`SparseState.begin_extend` / `begin_decode`), builds the step's plan (`planning.py` ->
`plans.py`, index tensors in one upload; for a captured decode graph, fixed buffers:
`decode_graph.py`) and runs each sparse layer through the kernels (`sparse_attention.py`), with
the cross-layer guide (`guide.py`) and the sentence marks (`policies/sentences.py`). Nothing here imports
SGLang.
"""
