"""Deprecated public names still give what they named, with a DeprecationWarning naming the new one."""
from __future__ import annotations

import pytest

import popcompile
from popcompile.runtime import ort


def test_popsession_is_ortsession_and_warns():
    with pytest.warns(DeprecationWarning, match="use OrtSession"):
        assert ort.PopSession is ort.OrtSession
    with pytest.warns(DeprecationWarning, match="use OrtSession"):
        assert popcompile.PopSession is ort.OrtSession
    with pytest.warns(DeprecationWarning, match="use OrtSession"):
        from popcompile.runtime.ort import PopSession  # noqa: F401


def test_top_level_pop_pass_points_at_the_pass_compile_runs():
    from popcompile.passes import pop, prefill

    with pytest.warns(DeprecationWarning, match="use pop_graphs"):
        assert popcompile.pop_pass is pop.pop_pass
    assert popcompile.pop_graphs is prefill.pop_graphs


def test_deprecated_names_are_not_exported_by_star():
    assert {"PopSession", "pop_pass"}.isdisjoint(popcompile.__all__)
    assert {"OrtSession", "pop_graphs"} <= set(popcompile.__all__)


def test_unknown_names_still_fail():
    with pytest.raises(AttributeError):
        ort.NoSuchSession  # noqa: B018
