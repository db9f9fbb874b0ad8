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


def test_deprecated_names_are_not_exported_by_star():
    assert "PopSession" not in popcompile.__all__ and "OrtSession" in popcompile.__all__


def test_unknown_names_still_fail():
    with pytest.raises(AttributeError):
        ort.NoSuchSession  # noqa: B018
