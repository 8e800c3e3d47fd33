"""Every option of SGLang 0.5.23's groups that touch the KV pool, the radix tree, attention,
admission or parallelism (`independent_options.OPTION_GROUPS`) has one row in the option table,
read from SGLang's own declarations: an option a new SGLang adds fails here until it is placed.
And every spelling SGLang's parser accepts for a refused option (its aliases and deprecated flags)
is refused, as the launcher reads it (`patches/server_entry.py`: what the parser made of the command
line, then the resolved arguments)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import msgspec
import pytest

from sglang_kvsparse.server.independent_options import INDEPENDENT, OPTION_GROUPS
from sglang_kvsparse.server.option_support import REFUSED, SERVED, checked_values, option_problems

pytestmark = pytest.mark.integration


def _group_fields() -> dict[str, list[str]]:
    """SGLang's option groups (`ServerArgs` namespaces) -> their fields, bookkeeping ones left out."""
    from sglang.srt.arg_groups import fields

    groups: dict[str, list[str]] = {}
    for module_info in pkgutil.iter_modules(fields.__path__):
        module = importlib.import_module(f"{fields.__name__}.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and hasattr(value, "_NS_PATH"):
                names = [field.name for field in msgspec.structs.fields(value) if not field.name.startswith("_")]
                groups.setdefault(value._NS_PATH, []).extend(names)
    return groups


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser


def test_every_option_of_the_groups_that_touch_the_sparse_layers_has_one_row():
    groups = _group_fields()
    assert set(OPTION_GROUPS) <= set(groups), set(OPTION_GROUPS) - set(groups)
    rows = [option.flag for option in REFUSED] + list(SERVED) + list(INDEPENDENT)
    covered = [_flag(field) for group in OPTION_GROUPS for field in groups[group]]
    assert len(covered) > 150
    missing = [flag for flag in covered if flag not in rows]
    assert not missing, f"options without a row in the table: {missing}"
    assert len(rows) == len(set(rows)), "an option in two parts of the table"
    every_field = {_flag(field) for names in groups.values() for field in names}
    assert not set(rows) - every_field, f"rows for options SGLang does not have: {set(rows) - every_field}"


def _a_value(action: argparse.Action, unused: tuple) -> list[str]:
    """Command-line words that put `action`'s option in use (a value outside `unused`)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [next(str(choice) for choice in action.choices if choice not in unused and choice not in ("", None))]
    return ["2"] if action.type is int else ["x"]


@pytest.mark.parametrize("refused", REFUSED, ids=lambda option: option.flag)
def test_every_spelling_of_a_refused_option_is_refused(refused):
    parser = _parser()
    actions = [action for action in parser._actions if action.dest == refused.field]
    spellings = [(action, spelling) for action in actions for spelling in action.option_strings]
    assert spellings, f"SGLang has no option {refused.flag}"
    for action, spelling in spellings:
        if spelling.startswith("--no-"):  # the negative of a switch turns it off
            continue
        parsed, unknown = parser.parse_known_args(["--model-path", "m", spelling, *_a_value(action, refused.unused)])
        assert not unknown
        problems = option_problems(checked_values(parsed), {})
        assert any(line.startswith(refused.flag) for line in problems), (spelling, problems)
