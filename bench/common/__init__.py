"""Helpers shared by the benchmark scripts in ``bench/`` (serving, capacity, fidelity).

They drive SGLang only through its command-line modules (subprocesses), so a benchmark measures
exactly what a user would run, and stock SGLang is never altered by the harness itself.
"""
