"""The report's figures must be byte-reproducible: nothing in them may follow set order."""

from kvreplay.experiments.resample.section import answer_order


def test_answer_order_puts_pooled_counts_first_and_breaks_ties_by_text() -> None:
    live = {"7": 2, "5": 1, "unparsed": 1}
    prefill = {"5": 1, "3": 2, "9": 4}
    assert answer_order(live, prefill) == ["9", "3", "5", "7", "unparsed"]


def test_answer_order_does_not_depend_on_insertion_order() -> None:
    counts = {str(a): 1 for a in range(40)}
    reversed_counts = dict(reversed(list(counts.items())))
    assert answer_order(counts, {}) == answer_order({}, reversed_counts) == sorted(counts)
