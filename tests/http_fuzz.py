"""Seeded fuzzing of one HTTP route with hypothesis (the Responses and Messages routes'
tests): JSON values of any shape, and a runner that posts each drawn body and checks it is
answered (200) or refused with a 4xx, never a 500."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
# any JSON value, a few levels deep
VALUE = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


def post_each(http, path: str, base: dict, bodies, check_error: Callable[[dict], None],
              check_answer: Callable[[dict], None], examples: int = 60) -> None:
    """POST `base` updated by each drawn body (derandomized: the same bodies every run) to
    `path`: a 200 passes `check_answer`, a 4xx `check_error` (its JSON), nothing else."""
    @settings(derandomize=True, database=None, deadline=None, max_examples=examples,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(bodies)
    def one(b):
        r = http.post(path, json={**base, **b})
        assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
        (check_answer if r.status_code == 200 else check_error)(r.json())

    one()
