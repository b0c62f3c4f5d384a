"""``kvtier bench tp-numerics``'s comparison (the engines it runs: the bench itself)."""

from __future__ import annotations

from kvtier.bench.engine.tp_numerics import compare


def test_positions_are_compared_token_by_token() -> None:
    reference = [[None, {"5": -1.0, "7": -0.5}, {"9": -2.0}], [None, {"3": -0.25}]]
    same = [[None, {"5": -1.0, "7": -0.5}, {"9": -2.0}], [None, {"3": -0.25}]]
    assert compare(reference, same) == {"positions": 3, "identical": 3, "max_abs_diff": 0.0}
    # another top-1 token at one position, a last-bit change at another
    other = [[None, {"5": -1.0, "8": -0.4}, {"9": -2.0 + 2**-20}], [None, {"3": -0.25}]]
    got = compare(reference, other)
    assert (got["positions"], got["identical"]) == (3, 1)
    assert got["max_abs_diff"] == 2**-20  # only tokens both list are compared


def test_prompts_must_match_in_number_and_length() -> None:
    import pytest

    with pytest.raises(ValueError):
        compare([[None, {"1": 0.0}]], [[None]])
