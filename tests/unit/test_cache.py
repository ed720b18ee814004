"""Process-wide caches hold a bounded number of entries (issue 52)."""

from __future__ import annotations

from kvreplay.backends import rollout
from kvreplay.core.cache import Recent


def test_a_recent_cache_makes_each_value_once_and_forgets_the_one_used_longest_ago() -> None:
    made: list[str] = []
    cache: Recent[str, str] = Recent(2)

    def get(key: str) -> str:
        return cache.get(key, lambda: made.append(key) or key.upper())

    assert [get("a"), get("b"), get("a")] == ["A", "B", "A"]
    assert made == ["a", "b"]
    get("c")  # "b" was used longest ago
    assert ("a" in cache, "b" in cache, "c" in cache, len(cache)) == (True, False, True, 2)
    get("b")
    assert made == ["a", "b", "c", "b"]


def test_the_scorer_caches_are_bounded() -> None:
    assert isinstance(rollout._OPENED, Recent) and rollout._OPENED.size == rollout.OPENED_MODELS
    assert isinstance(rollout._DIGESTS, Recent) and rollout._DIGESTS.size <= 64
