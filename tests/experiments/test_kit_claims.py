

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
