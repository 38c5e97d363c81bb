"""Every check in routelab._checks called directly, on valid inputs and on the probes that must fail.

The contract (the module docstring): bad input fails early with a ``ValueError`` (``TypeError`` for
a wrong type) whose message names the argument. So each invalid probe below asserts the exception
type and a message that starts with (or contains) the name passed in; the names are deliberately
not the defaults (``sweeps``, ``lr``, ``temperature``...) so a message that names a fixed word
instead of the argument fails. Valid probes assert the returned value, worked out by hand.

Probes: a bool where an int goes (``True`` is not 1), 0 and negative numbers, NaN and inf,
fractions, strings, wrong dtypes and shapes, a temperature of 0 where it must be > 0, a capacity
one token short. (``check_finite`` has its own file, tests/test_checks_finite.py; here it is only
called once. NumPy integer token counts in ``expert_capacity``/``balanced_quotas`` are not probed
here.)
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch

from routelab import _checks as C

NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------- integers


@pytest.mark.parametrize("good", [1, 7, np.int64(3), np.int8(1), np.uint16(5)])
def test_check_positive_int_returns_a_python_int(good: object) -> None:
    got = C.check_positive_int("sweeps", good)
    assert got == int(good) and type(got) is int


@pytest.mark.parametrize("bad", [True, False, np.True_, 0, -1, np.int64(0), 1.0, 2.5, "2", None, torch.tensor(2)])
def test_check_positive_int_refuses_bools_zero_negatives_and_non_integers(bad: object) -> None:
    """A bool is not a count: ``True`` would silently be 1 sweep."""
    with pytest.raises(ValueError, match=r"^sweeps must be a positive integer \(an int >= 1\), got "):
        C.check_positive_int("sweeps", bad)


def test_check_positive_int_upper_bound_and_check_k() -> None:
    assert C.check_positive_int("depth", 4, upper=4, upper_name="layers") == 4
    with pytest.raises(ValueError, match=r"^depth=5 is larger than layers=4: depth must be an integer in \[1, 4\]"):
        C.check_positive_int("depth", 5, upper=4, upper_name="layers")
    assert C.check_k(1, 4) == 1 and C.check_k(np.int32(4), 4) == 4
    with pytest.raises(ValueError, match=r"^k=5 is larger than num_experts=4"):
        C.check_k(5, 4)
    for bad in (True, 0, -2, 2.0):
        with pytest.raises(ValueError, match=r"^k must be a positive integer"):
            C.check_k(bad, 4)


# -------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(("good", "want"), [(True, True), (False, False), (np.True_, True), (np.False_, False)])
def test_check_flag_accepts_python_and_numpy_bools(good: object, want: bool) -> None:
    got = C.check_flag("hard", good)
    assert got is want


@pytest.mark.parametrize("bad", ["False", "True", 0, 1, 1.0, None, torch.tensor(True)])
def test_check_flag_refuses_strings_and_numbers(bad: object) -> None:
    """``bool("False")`` is True: a string or a number is not taken for a flag."""
    with pytest.raises(TypeError, match=r"^importance_weighting must be True or False, got "):
        C.check_flag("importance_weighting", bad)


# ---------------------------------------------------------------------------------- real numbers


@pytest.mark.parametrize(("good", "want"), [(0, 0.0), (0.0, 0.0), (2.5, 2.5), (np.float32(0.5), 0.5),
                                            (torch.tensor(2.5), 2.5), (3, 3.0)])
def test_check_nonneg_accepts_finite_numbers_from_zero(good: object, want: float) -> None:
    got = C.check_nonneg("lr", good)
    assert got == want and type(got) is float


@pytest.mark.parametrize("bad", [-1e-12, -1, NAN, INF, -INF, True, "1", None, torch.tensor([2.5])])
def test_check_nonneg_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got "):
        C.check_nonneg("lr", bad)


@pytest.mark.parametrize(("good", "want"), [(1e-300, 1e-300), (2, 2.0), (np.float64(0.25), 0.25),
                                            (torch.tensor(4.0), 4.0)])
def test_check_pos_accepts_finite_positive_numbers(good: object, want: float) -> None:
    assert C.check_pos("noise", good) == want


@pytest.mark.parametrize("bad", [0, 0.0, -0.0, -3, NAN, INF, True, "2", torch.tensor(0.0)])
def test_check_pos_refuses_zero_negative_and_non_numbers(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^noise must be a finite number > 0, got "):
        C.check_pos("noise", bad)


# ----------------------------------------------------------------------- command-line arguments


def test_device_names_and_argparse_types() -> None:
    for good in ("cpu", "cuda", "cuda:1", "cpu:0"):
        assert C.is_device_name(good) and C.device_arg(good) == good
    for bad in ("gpu", "mps", "", "cuda:x"):
        assert not C.is_device_name(bad)
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"got {bad!r}")):
            C.device_arg(bad)
    assert C.positive_int_arg("3") == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
            C.positive_int_arg(bad)


# ----------------------------------------------------------------------------- seeds, generators


@pytest.mark.parametrize(("good", "want"), [(0, 0), (2**64 - 1, 2**64 - 1), (np.uint64(7), 7), (torch.tensor(5), 5)])
def test_check_seed_accepts_integers_in_range(good: object, want: int) -> None:
    got = C.check_seed(good)
    assert got == want and type(got) is int


@pytest.mark.parametrize("bad", [True, False, -1, 2**64, 1.0, "1", None, torch.tensor(5.0)])
def test_check_seed_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^data_seed must be an integer in \[0, 2\*\*64\), got "):
        C.check_seed(bad, "data_seed")


def test_check_generator_and_the_generator_attribute() -> None:
    C.check_generator(None)
    C.check_generator(torch.Generator())
    for bad in (0, "gen", np.random.default_rng(0)):
        with pytest.raises(TypeError, match=r"^noise_generator must be a torch.Generator or None, got "):
            C.check_generator(bad, "noise_generator")

    class Holder:
        rng = C.GeneratorAttribute("the generator")

    h = Holder()
    assert h.rng is None
    g = torch.Generator()
    h.rng = g
    assert h.rng is g
    with pytest.raises(TypeError, match=r"^rng must be a torch.Generator or None, got int"):
        h.rng = 1
    assert h.rng is g  # a refused assignment leaves the old value


def test_random_tensor_draws_from_the_generator() -> None:
    draw = [C.random_tensor(torch.rand, (4,), dtype=torch.float64, device="cpu",
                            generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draw[0], draw[1]) and draw[0].dtype == torch.float64
    assert torch.equal(draw[0], torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    free = C.random_tensor(torch.randn, (2, 3), dtype=torch.float32, device="cpu", generator=None)
    assert free.shape == (2, 3) and free.dtype == torch.float32


# ---------------------------------------------------------------------------- the temperature


@pytest.mark.parametrize(("tau", "positive", "want"), [(0.0, False, 0.0), (0, False, 0.0), (0.5, True, 0.5),
                                                       (torch.tensor(2.0), True, 2.0), (np.float32(1.0), True, 1.0)])
def test_check_tau_accepts(tau: object, positive: bool, want: float) -> None:
    got = C.check_tau(tau, positive=positive, name="temperature")
    assert got == want and type(got) is float


@pytest.mark.parametrize(("tau", "positive"), [(0.0, True), (0, True), (-0.0, True), (-1e-9, False),
                                               (-1.0, True), (NAN, False), (INF, False), (-INF, True)])
def test_check_tau_refuses_values_naming_the_bound(tau: float, positive: bool) -> None:
    """0 is the deterministic limit where allowed; where a softmax(logits / tau) is sampled it is not."""
    bound = "> 0" if positive else ">= 0"
    with pytest.raises(ValueError, match=rf"^temperature must be a finite number {bound}"):
        C.check_tau(tau, positive=positive, name="temperature")


@pytest.mark.parametrize("bad", [True, False, "1", b"1", None, [1.0, 2.0], torch.tensor(True),
                                 torch.tensor(1 + 1j), torch.tensor([1.0, 2.0])])
def test_check_tau_refuses_types(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^temperature must be a real number, got ") as info:
        C.check_tau(bad, name="temperature")
    assert isinstance(info.value, ValueError)  # an ArgumentTypeError: callers catching either see it


def test_tau_tensor_a_number_and_a_tensor_of_the_batch_shape() -> None:
    like = torch.zeros(1, dtype=torch.float64)
    T, invalid = C.tau_tensor(0.5, torch.Size([2, 3]), like)
    assert T.shape == (1, 1) and T.dtype == torch.float64 and T.item() == 0.5 and not bool(invalid)
    per = torch.tensor([[0.1, 1.0, 10.0], [1.0, 2.0, 3.0]])
    T, invalid = C.tau_tensor(per, torch.Size([2, 3]), like)
    assert T.shape == (2, 3, 1, 1) and torch.equal(T[..., 0, 0], per.double()) and not bool(invalid)
    T, invalid = C.tau_tensor(torch.tensor(2), torch.Size([4]), torch.zeros(1))  # a 0-dim integer tensor
    assert T.shape == (1, 1) and T.item() == 2.0 and not bool(invalid)


@pytest.mark.parametrize("tau", [0.0, 0, -0.0, -1.0, NAN, INF, torch.tensor(0.0)])
def test_tau_tensor_flags_a_number_that_is_not_finite_and_positive(tau: object) -> None:
    _, invalid = C.tau_tensor(tau, torch.Size([2]), torch.zeros(1))
    assert invalid.dtype == torch.bool and invalid.shape == () and bool(invalid)


@pytest.mark.parametrize("bad_entry", [0.0, -2.0, NAN, INF])
def test_tau_tensor_flags_one_bad_temperature_among_many(bad_entry: float) -> None:
    per = torch.ones(2, 3)
    per[1, 2] = bad_entry
    _, invalid = C.tau_tensor(per, torch.Size([2, 3]), torch.zeros(1))
    assert bool(invalid)


@pytest.mark.parametrize("shape", [(3, 2), (6,), (2, 3, 1), (2,)])
def test_tau_tensor_refuses_a_tensor_of_another_shape(shape: tuple[int, ...]) -> None:
    """One temperature per batch instance means exactly the batch shape: a transposed [3, 2] for a
    [2, 3] batch has the same count and would broadcast wrongly or fail later."""
    with pytest.raises(ValueError, match=re.escape(f"temperature must be a number or a tensor of the batch shape "
                                                   f"(2, 3), got shape {shape}")):
        C.tau_tensor(torch.ones(shape), torch.Size([2, 3]), torch.zeros(1), name="temperature")


@pytest.mark.parametrize("bad", [True, "0.5", None, [0.5], torch.tensor([True, False]),
                                 torch.tensor([1 + 1j]), torch.tensor([1, 2], dtype=torch.int16)])
def test_tau_tensor_refuses_types(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^temperature must be a number or a real tensor of the batch shape, got "):
        C.tau_tensor(bad, torch.Size([2]), torch.zeros(1), name="temperature")


def test_bad_tau_names_the_argument_and_the_dtype() -> None:
    err = C.bad_tau(0.0, "temperature")
    assert isinstance(err, ValueError) and str(err).startswith("temperature must be a finite number > 0, got 0.0")
    err = C.bad_tau(1e-50, "temperature", dtype=torch.float32)
    assert str(err).startswith("temperature=1e-50 is finite and > 0, but not representable in the logits' dtype "
                               "torch.float32")


# ------------------------------------------------------------------------------------- tensors


def test_checks_run_outside_compile() -> None:
    assert C.checks_run() is True


def test_check_plain_tensor_refuses_torch_func_wrappers() -> None:
    C.check_plain_tensor(torch.ones(2, 3), "scores", "the solver")

    def solve(x: torch.Tensor) -> torch.Tensor:
        C.check_plain_tensor(x, "scores", "the solver")
        return x

    with pytest.raises(NotImplementedError, match=r"^the solver does not run inside torch.func .*: scores has no "):
        torch.func.vmap(solve)(torch.ones(2, 3))


def test_check_score_maximum() -> None:
    for fine in (1.0, -5.0, -INF, 3e38):
        C.check_score_maximum(fine, "logits")
    with pytest.raises(ValueError, match=r"^logits contains NaN"):
        C.check_score_maximum(NAN, "logits")
    with pytest.raises(ValueError, match=r"^logits contains \+inf"):
        C.check_score_maximum(INF, "logits")


def test_check_score_matrix_accepts_floating_matrices_with_forbidden_pairs() -> None:
    s = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    s[0, 1, 2] = -INF
    C.check_score_matrix(s, "logits")
    C.check_score_matrix(s.half(), "logits")
    nan = torch.ones(4, 2)
    nan[1, 1] = NAN
    C.check_score_matrix(nan, "logits", values=False)  # type and shape only


@pytest.mark.parametrize(("bad", "kwargs", "error", "message"), [
    ([[1.0, 2.0]], {}, TypeError, r"^logits must be a torch.Tensor of shape \[..., n, k\], got list"),
    (torch.ones(4), {}, ValueError, r"^logits must have at least 2 dimensions \[..., n, k\]"),
    (torch.ones(4, 2, dtype=torch.long), {}, ValueError, r"^logits must be a floating tensor"),
    (torch.ones(4, 2, dtype=torch.bool), {}, ValueError, r"^logits must be a floating tensor"),
    (torch.ones(0, 2), {}, ValueError, r"^logits must have at least one token and one expert"),
    (torch.ones(3, 0), {}, ValueError, r"^logits must have at least one token and one expert"),
    (torch.tensor([[1.0, NAN], [0.0, 1.0]]), {}, ValueError, r"^logits contains NaN"),
    (torch.tensor([[NAN, -INF]]), {}, ValueError, r"^logits contains NaN"),
    (torch.tensor([[1.0, INF]]), {}, ValueError, r"^logits contains \+inf"),
    (torch.tensor([[1.0, -INF]]), {"allow_neg_inf": False}, ValueError, r"^logits contains -inf"),
])
def test_check_score_matrix_refuses(bad: object, kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        C.check_score_matrix(bad, "logits", **kwargs)


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_check_finite_once(bad: float) -> None:
    C.check_finite(torch.tensor([-3e38, 3e38]), "gates", "lower the learning rate")
    with pytest.raises(ValueError, match=r"^gates are not finite \(NaN or inf\): lower the learning rate"):
        C.check_finite(torch.tensor([1.0, bad]), "gates", "lower the learning rate")


def test_floating_input() -> None:
    x = torch.ones(2, dtype=torch.float64)
    out = C.floating_input(x, "hidden", torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(2))
    same = torch.ones(2)
    assert C.floating_input(same, "hidden", torch.float32) is same
    for bad in (torch.ones(2, dtype=torch.long), torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.cfloat)):
        with pytest.raises(ValueError, match=r"^hidden must be a floating tensor .* got torch\."):
            C.floating_input(bad, "hidden", torch.float32)
    with pytest.raises(TypeError, match=r"^hidden must be a torch.Tensor, got list"):
        C.floating_input([1.0], "hidden", torch.float32)


def test_index_tensor() -> None:
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    got = C.index_tensor(idx, "expert")
    assert got.dtype == torch.long and torch.equal(got, idx.long())
    as_long = idx.long()
    assert C.index_tensor(as_long, "expert") is as_long
    for bad in (idx.float(), idx.bool()):
        with pytest.raises(ValueError, match=r"^expert must be an integer tensor"):
            C.index_tensor(bad, "expert")
    for bad in (idx[0], idx[None]):
        with pytest.raises(ValueError, match=r"^expert must have 2 dimensions \[tokens, slots\], got shape"):
            C.index_tensor(bad, "expert")
    with pytest.raises(TypeError, match=r"^expert must be a LongTensor \[tokens, slots\], got list"):
        C.index_tensor([[0, 1]], "expert")


def test_token_mask() -> None:
    assert C.token_mask(None, (2, 4), "attention") is None
    m = torch.ones(2, 4, dtype=torch.bool)
    assert C.token_mask(m, torch.Size([2, 4]), "attention") is m
    with pytest.raises(ValueError, match=re.escape("attention must have the token shape (2, 4) (x.shape[:-1]), "
                                                   "got (4, 2)")):
        C.token_mask(torch.ones(4, 2, dtype=torch.bool), (2, 4), "attention")
    with pytest.raises(ValueError, match=re.escape("attention must have the token shape (2, 4)")):
        C.token_mask(torch.ones(8, dtype=torch.bool), (2, 4), "attention")  # same count, other shape
    with pytest.raises(ValueError, match=r"^attention must be a BoolTensor \(True = real token\), got torch.int64"):
        C.token_mask(torch.ones(2, 4, dtype=torch.long), (2, 4), "attention")
    with pytest.raises(TypeError, match=r"^attention must be a BoolTensor of the token shape \(2, 4\)"):
        C.token_mask([[True] * 4] * 2, (2, 4), "attention")


def test_mask_tensor() -> None:
    m = torch.ones(3, 2, dtype=torch.bool)
    assert C.mask_tensor(m, "keep", torch.Size([3, 2])) is m
    with pytest.raises(ValueError, match=re.escape("keep must have the shape of expert [tokens, slots] = (3, 2), "
                                                   "got (2, 3)")):
        C.mask_tensor(torch.ones(2, 3, dtype=torch.bool), "keep", torch.Size([3, 2]))
    with pytest.raises(ValueError, match=r"^keep must be a BoolTensor \[tokens, slots\], got torch.float32"):
        C.mask_tensor(torch.ones(3, 2), "keep", torch.Size([3, 2]))
    with pytest.raises(TypeError, match=r"^keep must be a BoolTensor \[tokens, slots\], got NoneType"):
        C.mask_tensor(None, "keep", torch.Size([3, 2]))


# ------------------------------------------------------------------------------------ capacity


@pytest.mark.parametrize(("n", "k", "capacity", "kwargs", "want"), [
    (8, 4, None, {}, 2),                      # exact default: n / k
    (9, 4, None, {"default": "ceil"}, 3),     # ceil(9 / 4)
    (0, 4, None, {"default": "ceil"}, 1),     # max(ceil, 1)
    (9, 4, 3, {}, 3),                         # 3 * 4 = 12 >= 9
    (8, 4, 2, {}, 2),                         # the edge: 2 * 4 = 8 holds exactly n = 8
    (7, 1, 7, {}, 7),
    (8, 4, 4.0, {}, 4),                       # an integral float
    (8, 4, torch.tensor(3), {}, 3),
    (4, 2, 10, {"at_most_tokens": True}, 4),  # min(c, n)
    (4, 2, 10, {}, 10),
])
def test_resolve_capacity_accepts(n: int, k: int, capacity: object, kwargs: dict, want: int) -> None:
    got = C.resolve_capacity(n, k, capacity, "slots_per_expert", **kwargs)
    assert got == want and type(got) is int


@pytest.mark.parametrize(("n", "k"), [(9, 4), (7, 2), (10, 4), (17, 8)])
def test_resolve_capacity_refuses_one_token_too_few(n: int, k: int) -> None:
    """The largest capacity that cannot hold every token, ``ceil(n/k) - 1``: ``c * k < n``, often just by one."""
    c = -(-n // k) - 1
    with pytest.raises(ValueError, match=re.escape(
            f"slots_per_expert={c} with k={k} experts holds only {c * k} tokens but n={n} must be placed; "
            f"use slots_per_expert >= ceil(n/k) = {-(-n // k)}")):
        C.resolve_capacity(n, k, c, "slots_per_expert")


def test_resolve_capacity_one_short_by_exactly_one_token() -> None:
    """n = 9, k = 4, capacity 2 holds 8: one token has no place (not a rounding tolerance)."""
    with pytest.raises(ValueError, match=r"^slots_per_expert=2 with k=4 experts holds only 8 tokens but n=9"):
        C.resolve_capacity(9, 4, 2, "slots_per_expert")
    with pytest.raises(ValueError, match=r"^slots_per_expert=2 with E=4 experts holds only 8 pairs but "
                                         r"n\*k=9 must be placed; raise it$"):
        C.resolve_capacity(9, 4, 2, "slots_per_expert", fix="raise it", counts=("pairs", "n*k=9", "E=4"))


@pytest.mark.parametrize(("n", "k"), [(9, 4), (10, 4), (7, 2), (1, 2)])
def test_resolve_capacity_exact_default_needs_k_to_divide_n(n: int, k: int) -> None:
    with pytest.raises(ValueError, match=re.escape(
            f"n={n} tokens are not divisible by k={k} experts, so the balanced capacity n/k is not an integer; "
            f"pass slots_per_expert=ceil(n/k)={-(-n // k)} (or larger) explicitly")):
        C.resolve_capacity(n, k, None, "slots_per_expert")


@pytest.mark.parametrize("bad", [True, False, 0, -1, 2.5, INF, NAN, "4", [4]])
def test_resolve_capacity_refuses_non_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^slots_per_expert must be a positive integer"):
        C.resolve_capacity(8, 4, bad, "slots_per_expert")


@pytest.mark.parametrize(("n", "e", "k", "want"), [(10, 4, 1, (2, 3)), (10, 4, 2, (5, 5)), (0, 4, 1, (0, 0)),
                                                   (3, 8, 1, (0, 1)), (7, 3, 3, (7, 7))])
def test_balanced_quotas(n: int, e: int, k: int, want: tuple[int, int]) -> None:
    assert C.balanced_quotas(n, e, k) == want


@pytest.mark.parametrize(("args", "message"), [
    ((-1, 4), r"^num_tokens must be an integer >= 0"),
    ((True, 4), r"^num_tokens must be an integer >= 0"),
    ((8.0, 4), r"^num_tokens must be an integer >= 0"),
    ((8, 0), r"^num_experts must be a positive integer"),
    ((8, True), r"^num_experts must be a positive integer"),
    ((8, 4, 5), r"^k=5 is larger than num_experts=4"),
    ((8, 4, 0), r"^k must be a positive integer"),
])
def test_balanced_quotas_refuses(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        C.balanced_quotas(*args)


def test_check_capacity() -> None:
    assert C.check_capacity(None) is None
    assert C.check_capacity(0) == 0 and C.check_capacity(0.0) == 0  # an empty batch
    assert C.check_capacity(3, "cap") == 3 and C.check_capacity(4.0, "cap") == 4
    for bad in (-1, 1.5, True, False, np.False_, INF, NAN, "3"):
        with pytest.raises(ValueError, match=r"^cap must be a positive integer"):
            C.check_capacity(bad, "cap")


def test_check_capacity_factor() -> None:
    C.check_capacity_factor(None)
    C.check_capacity_factor(1.25)
    C.check_capacity_factor(1)
    for bad in (0, 0.0, -1.0, NAN, INF, True, "1.0"):
        with pytest.raises(ValueError, match=r"^capacity_factor must be a finite number > 0"):
            C.check_capacity_factor(bad)


@pytest.mark.parametrize(("args", "want"), [
    ((10, 4, 1, 1.0), 3),          # ceil(2.5)
    ((8, 4, 1, 1.0), 2),           # exactly 2
    ((100, 11, 1, 1.1), 10),       # 1.1 * 100 / 11 = 10.000000000000002 in floats: still 10
    ((8, 4, 2, 1.25), 5),
    ((10, 4, 1, None), 10),        # dropless
    ((0, 4, 1, 1.0), 0),           # no tokens
    ((1, 4, 1, 0.01), 1),          # at least 1 when there are tokens
    ((10, 4, 1, 100.0), 10),       # never above n
    ((10, 4, 1e308, 1e308), 10),   # the product overflows to inf
])
def test_expert_capacity(args: tuple, want: int) -> None:
    got = C.expert_capacity(*args)
    assert got == want and type(got) is int


@pytest.mark.parametrize(("args", "message"), [
    ((-1, 4, 1, 1.0), r"^num_tokens must be an integer >= 0"),
    ((True, 4, 1, 1.0), r"^num_tokens must be an integer >= 0"),
    ((10.0, 4, 1, 1.0), r"^num_tokens must be an integer >= 0"),
    ((10, 0, 1, 1.0), r"^num_experts must be a positive integer"),
    ((10, True, 1, 1.0), r"^num_experts must be a positive integer"),
    ((10, 4, 0, 1.0), r"^slots must be a finite number > 0"),
    ((10, 4, NAN, 1.0), r"^slots must be a finite number > 0"),
    ((10, 4, 1, 0.0), r"^capacity_factor must be a finite number > 0"),
    ((10, 4, 1, -1.0), r"^capacity_factor must be a finite number > 0"),
    ((10, 4, 1, INF), r"^capacity_factor must be a finite number > 0"),
])
def test_expert_capacity_refuses(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        C.expert_capacity(*args)
