

def test_a_verdict_reached_on_one_seed_says_so() -> None:
    """A review case: on one seed a "beyond 2 s.e." criterion has no standard error, and the quick
    runs' verdicts read as judged against the seed spread."""
    from routelab.experiments.kit.claims import HOLDS, NOT_MEASURED, PARTLY, SINGLE_SEED, Claim, single_seed

    claims = [Claim(text="a", measured="1", verdict=HOLDS), Claim(text="b", measured="2", verdict="partly (tie)"),
              Claim(text="c", measured="-", verdict=NOT_MEASURED)]
    one = single_seed(claims, 1)
    assert [c.verdict for c in one] == [f"holds ({SINGLE_SEED})", f"partly ({SINGLE_SEED}; tie)", NOT_MEASURED]
    assert [c.outcome for c in one] == [HOLDS, PARTLY, NOT_MEASURED]  # the scoreboard still counts them
    assert single_seed(claims, 3) == claims


def test_non_finite_values_left_out_of_a_mean_are_shown() -> None:
    """A review case: a NaN result was silently left out of the mean (and of the paired claims)
    while the table counted its run."""
    from routelab.experiments.kit.stats import mean_se, paired_difference

    stat = mean_se([1.0, 2.0, float("nan"), None])
    assert (stat.n, stat.non_finite) == (2, 1) and stat.fmt(1) == "1.5 ± 0.5 (1 non-finite left out)"
    assert mean_se([1.0, 3.0]).fmt(1) == "2.0 ± 1.0"
    d = paired_difference({0: 1.0, 1: float("inf"), 2: 2.0}, {0: 0.5, 1: 1.0, 2: None})
    assert (d.n, d.non_finite, d.mean) == (1, 1, 0.5)


def test_numbers_read_a_thousands_separator_as_part_of_the_number() -> None:
    """A review: "60,000" was read as [60.0, 0.0]. A comma followed by exactly three digits joins; a comma then
    a blank, or then another count of digits, separates two numbers."""
    from routelab.experiments.kit.claims import Claim

    def numbers(measured: str) -> list[float]:
        return Claim(text="t", measured=measured, verdict="holds").numbers

    assert numbers("60,000 images, loss 1e-3") == [60000.0, 0.001]
    assert numbers("12,345.5 and −1,000,000") == [12345.5, -1000000.0]
    assert numbers("seeds 1, 2, 3") == [1.0, 2.0, 3.0]
    assert numbers("1,2 and 1,2345 and 1234,567") == [1.0, 2.0, 1.0, 2345.0, 1234.0, 567.0]
    assert numbers("top-1 1.5 of 4, 40 %") == [1.5, 4.0, 40.0]
