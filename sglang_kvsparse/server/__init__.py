"""Serving with sparse layers: what the launcher and the engine factory set up before SGLang
starts, and what the server reports.

Contract: `options.py` parses and validates the `--kvsparse-*` options against the model
(`model_support.py`), SGLang's options (`option_support.py`, `parallelism.py`, `backends.py`) and
the machine (`serving_defaults.py`: CPU defaults; `cpu_shims.py`: SGLang on a machine without a
GPU), and exports the configuration to every process; `accounting.py` and `stats.py` say what the
heap holds (start-up table, `/kvsparse/stats`). Nothing here imports SGLang's internals.
"""
