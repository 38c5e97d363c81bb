

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
