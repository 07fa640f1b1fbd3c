"""Typed argument checks shared by every public constructor.

Each check raises ConfigError naming the argument, what was given (repr) and what is
accepted, and returns the value in its canonical type. bool is rejected wherever a number
is expected: `True` as a count or a seed is always a mistake, though Python calls it an int.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NoReturn

from kvsession.errors import ConfigError

# what torch.Generator.manual_seed accepts: a seed outside it is refused up front, not at the
# first request that uses it
SEED_RANGE = (-(2**63), 2**64 - 1)


def _range(lo, hi, lo_incl: bool = True, hi_incl: bool = True) -> str:
    if lo is not None and hi is not None:
        return f" in {'[' if lo_incl else '('}{lo}, {hi}{']' if hi_incl else ')'}"
    if lo is not None:
        return f" {'>=' if lo_incl else '>'} {lo}"
    return "" if hi is None else f" {'<=' if hi_incl else '<'} {hi}"


def _fail(name: str, value, accepted: str, allow_none: bool) -> NoReturn:
    raise ConfigError(f"{name} must be {'None or ' if allow_none else ''}{accepted}, "
                      f"got {value!r}")


def check_int(name: str, value, *, min_value: int | None = None, max_value: int | None = None,
              allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or (
            min_value is not None and value < min_value) or (
            max_value is not None and value > max_value):
        _fail(name, value, "an int" + _range(min_value, max_value), allow_none)
    return int(value)


def check_priorities(value, n: int) -> list[int]:
    """`priority=` of a request call: None (0 for all), one int for all, or one per request
    (lower is more urgent, as vLLM)."""
    if value is None:
        return [0] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"priority has {len(value)} values for {n} requests")
        return [check_int("priority", v) for v in value]
    return [check_int("priority", value)] * n


def check_float(name: str, value, *, min_value: float | None = None,
                max_value: float | None = None, min_inclusive: bool = True,
                max_inclusive: bool = True, allow_none: bool = False,
                finite: bool = False) -> float | None:
    """finite: inf is refused too (durations: a timeout that never fires is a hang, and
    a wait past threading.TIMEOUT_MAX raises where nobody catches it)."""
    if value is None and allow_none:
        return None
    accepted = ("a finite number" if finite else "a number") + _range(
        min_value, max_value, min_inclusive, max_inclusive)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        _fail(name, value, accepted, allow_none)
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):  # a huge int, an odd Real subclass
        _fail(name, value, accepted, allow_none)
    below = min_value is not None and (f < min_value if min_inclusive else f <= min_value)
    above = max_value is not None and (f > max_value if max_inclusive else f >= max_value)
    if math.isnan(f) or (finite and math.isinf(f)) or below or above:
        _fail(name, value, accepted, allow_none)
    return f


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        _fail(name, value, "True or False", False)
    return value


def check_str(name: str, value, *, allow_none: bool = False,
              non_empty: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or (non_empty and not value):
        _fail(name, value, "a non-empty string" if non_empty else "a string", allow_none)
    return check_unicode(name, value)


def check_unicode(name: str, text: str) -> str:
    """`text` if it is valid Unicode. A lone surrogate (what json.loads makes of "\\ud800")
    is a str that no tokenizer takes (a TypeError from inside it) and no UTF-8 file holds
    (a session log record would fail to encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{name} must be valid Unicode text, got a lone surrogate "
                          f"{text[e.start]!r} at index {e.start}") from None
    return text


def check_path(name: str, value, *, allow_none: bool = False) -> Path | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        _fail(name, value, "a file path (str or os.PathLike)", allow_none)
    path = os.fspath(value)
    if not isinstance(path, str) or "\0" in path:  # a bytes PathLike; NUL: no OS takes it
        _fail(name, value, "a file path (str or os.PathLike)", allow_none)
    return Path(path)


def reject_unknown(owner: str, unknown: Mapping[str, object], allowed: Iterable[str], *,
                   hints: Mapping[str, str] | None = None) -> None:
    """Raise if `unknown` (the leftover **kwargs of `owner`) is non-empty. `hints` maps names
    that spelling cannot relate to the right one (an internal field, another library's name)."""
    if not unknown:
        return
    allowed = list(allowed)
    found = [(n, (hints or {}).get(n) or next(
        iter(difflib.get_close_matches(n, allowed, n=1, cutoff=0.6)), None)) for n in unknown]
    if len(found) == 1 and found[0][1]:
        raise ConfigError(f"{owner} got an unknown keyword argument {found[0][0]!r}; "
                          f"did you mean {found[0][1]!r}?")
    listed = ", ".join(f"{n!r} (did you mean {m!r}?)" if m else repr(n) for n, m in found)
    what = "an unknown keyword argument" if len(found) == 1 else "unknown keyword arguments"
    tail = "" if all(m for _, m in found) else f"; accepted: {', '.join(allowed)}"
    raise ConfigError(f"{owner} got {what} {listed}{tail}")
