"""The shared checks of values from outside: version names, opt-out spellings, JSON bodies."""

from __future__ import annotations

import pytest

from sglang_adaflash.validation import (
    FALSE_SPELLINGS,
    TRUE_SPELLINGS,
    InvalidVersion,
    is_version,
    parse_flag,
    parse_json_body,
    version_number,
)


@pytest.mark.parametrize("name, number", [("v000001", 1), ("v000042", 42), ("v1234567", 1234567)])
def test_version_names(name, number):
    assert is_version(name) and version_number(name) == number


@pytest.mark.parametrize("value", [
    "v００００08",  # fullwidth digits: \d matches them, int() reads them as 8
    "v٠٠٠٠٠١",  # Arabic-Indic digits
    "v000001\n",  # `$` matches before a trailing newline
    "v00001", "V000001", " v000001", "v000001 ", "latest", "../v000001", "",
    5, 1.5, True, None, ["v000001"], {"version": "v000001"},
])
def test_anything_else_is_not_a_version(value):
    assert not is_version(value)
    with pytest.raises(InvalidVersion, match="is not of the form v000001"):
        version_number(value)
    assert issubclass(InvalidVersion, ValueError)  # callers that catch ValueError keep working


@pytest.mark.parametrize("value", [True, 1, *TRUE_SPELLINGS, "True", "YES", " On ", "\ttrue\n"])
def test_yes_spellings(value):
    assert parse_flag(value, "f") is True


@pytest.mark.parametrize("value", [None, False, 0, *FALSE_SPELLINGS, "False", "NO", " off ", "   "])
def test_no_spellings(value):
    assert parse_flag(value, "f") is False


@pytest.mark.parametrize("value", ["maybe", "2", "y", "tru", "yes please", 2, -1, 1.0, [True], {"a": 1}])
def test_anything_else_is_an_error_naming_the_field(value):
    with pytest.raises(ValueError, match="^the-field must be true or false"):
        parse_flag(value, "the-field")


def test_json_bodies():
    assert parse_json_body(b'{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json_body(b"[" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json_body(b'{"a": ' + b'{"b": ' * 100_000)
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_json_body(b'{"a": "caf\xff"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json_body(b'{"a": ')
