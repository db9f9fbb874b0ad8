"""The plugin's two changes to vLLM methods go through here: once per process, recognisable, the original
kept."""
from __future__ import annotations

import functools
from typing import Any, Callable

_MARK = "__popcompile_original__"


def wrap_once(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.name = make(original)`` unless popcompile already wrapped it in this process."""
    original = getattr(owner, name)
    if getattr(original, _MARK, None) is not None:
        return
    wrapper: Any = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, original)
    setattr(owner, name, wrapper)
