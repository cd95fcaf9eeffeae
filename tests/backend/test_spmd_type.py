"""``SpmdType``: an SPMD type as a value, its local type and shard dim read from it, never parsed
back from its text; it compares and prints as its text, and pickles (ranks return it)."""

from __future__ import annotations

import json
import pickle

import pytest

from dtcompile.spmd.inference import P, R, SpmdType, format_types


def test_a_shard_is_varying_with_its_dim_and_reads_as_its_text():
    s1 = SpmdType.shard(1)
    assert (s1, s1.local, s1.dim) == ("S(1)", "V", 1)
    assert (P.local, P.dim) == ("P", None) and R == "R"
    assert format_types({"tp": s1, "dp": R}) == "dp:R tp:S(1)"
    assert json.dumps({"tp": s1}) == '{"tp": "S(1)"}'


def test_it_pickles_as_itself():
    for t in (SpmdType.shard(0), P, SpmdType("?")):
        back = pickle.loads(pickle.dumps(t))
        assert (back, back.local, back.dim, type(back)) == (t, t.local, t.dim, SpmdType)


def test_what_is_not_a_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"not an SPMD type: 'S\(1\)'"):
        SpmdType("S(1)")  # a shard is made with SpmdType.shard(1)
    with pytest.raises(ValueError, match="only a varying value shards a dim"):
        SpmdType("P", 0)
