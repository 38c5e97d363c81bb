"""Contracts of :class:`routelab.replay.NoiseReplay` that the other tests leave open (found by mutation).

Truth: the numbers each forward draw produced (recorded here by the test itself), the generator's
state before a replayed draw, and the documented errors.

* ``depth`` bounds the records: the oldest are forgotten, a backward pass replays the newest first
  (last-in first-out) and, once every remembered record is replayed, the next recomputation raises
  instead of silently replaying a record again;
* :meth:`NoiseReplay.clear` forgets every record;
* an exception raised inside a replayed draw still puts the generator back;
* a replay unpickled from before ``_task``/``_unreplayed`` existed (the class defaults) replays;
* under ``torch.compile`` nothing is recorded and the draw context compiles whole;
* a forward draw starts a new round of records: the next replay takes the newest record.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import pytest
import torch

from routelab.replay import NoiseReplay


def in_one_backward(body: Callable[[], None]) -> None:
    """Run ``body`` inside one backward pass (a tensor hook: where checkpointing recomputes)."""
    x = torch.ones((), requires_grad=True)
    errors: list[BaseException] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        try:
            body()
        except BaseException as exc:  # re-raised outside autograd below
            errors.append(exc)
        return grad

    x.register_hook(hook)
    (2 * x).backward()
    if errors:
        raise errors[0]


def forward_draws(replay: NoiseReplay, gen: torch.Generator, count: int) -> list[torch.Tensor]:
    drawn = []
    for _ in range(count):
        with replay.draw(gen):
            drawn.append(torch.rand(3, generator=gen))
    return drawn


def test_depth_keeps_the_newest_records_and_a_backward_replays_each_once_newest_first() -> None:
    """depth=3 after 5 forward draws: 3 records (the oldest 2 forgotten); one backward pass replays
    draws 5, 4, 3 in that order, then a 4th recomputation raises "no recorded forward noise" (it must
    neither replay draw 2 nor replay a record again); the generator is left untouched throughout."""
    gen = torch.Generator().manual_seed(21)
    replay = NoiseReplay(depth=3)
    drawn = forward_draws(replay, gen, 5)
    assert len(replay) == 3
    after = gen.get_state()
    replayed: list[torch.Tensor] = []

    def body() -> None:
        for _ in range(3):
            with replay.draw(gen):
                replayed.append(torch.rand(3, generator=gen))
            assert torch.equal(gen.get_state(), after)
        with pytest.raises(RuntimeError, match="no recorded forward noise"):
            with replay.draw(gen):
                torch.rand(3, generator=gen)

    in_one_backward(body)
    assert len(replayed) == 3
    for got, want in zip(replayed, [drawn[4], drawn[3], drawn[2]], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(gen.get_state(), after) and len(replay) == 3


def test_the_default_depth_remembers_64_forward_draws() -> None:
    """``NoiseReplay()`` remembers 64 forward draws (the documented default), not fewer, not more."""
    gen = torch.Generator().manual_seed(3)
    replay = NoiseReplay()
    assert replay.depth == 64
    forward_draws(replay, gen, 70)
    assert len(replay) == 64


def test_clear_forgets_every_record() -> None:
    """After ``clear()`` there is nothing to replay: a recomputation raises (it must not replay the
    noise of a forward from before the clear)."""
    gen = torch.Generator().manual_seed(4)
    replay = NoiseReplay(depth=4)
    forward_draws(replay, gen, 2)
    replay.clear()
    assert len(replay) == 0

    def body() -> None:
        with replay.draw(gen):
            torch.rand(3, generator=gen)

    with pytest.raises(RuntimeError, match="no recorded forward noise"):
        in_one_backward(body)


def test_an_error_inside_a_replayed_draw_puts_the_generator_back() -> None:
    """The generator is restored in a ``finally``: an exception raised by the recomputation inside
    the draw must not leave the generator at the replayed (forward's) state."""
    gen = torch.Generator().manual_seed(5)
    replay = NoiseReplay(depth=2)
    forward_draws(replay, gen, 1)
    torch.rand(5, generator=gen)  # the stream moves on: its state is not the forward's after the draw
    before = gen.get_state()
    seen = {}

    def body() -> None:
        try:
            with replay.draw(gen):
                torch.rand(3, generator=gen)
                raise KeyError("boom")
        except KeyError:
            pass
        seen["state"] = gen.get_state()

    in_one_backward(body)
    assert torch.equal(seen["state"], before)
    assert torch.equal(gen.get_state(), before)


def test_a_replay_pickled_before_its_replay_counters_existed_still_replays() -> None:
    """A replay whose pickle lacks ``_task`` and ``_unreplayed`` (the class defaults stand in for
    them) replays its record in a recomputation that comes before any new forward."""
    gen = torch.Generator().manual_seed(6)
    old = NoiseReplay(depth=4)
    (drawn,) = forward_draws(old, gen, 1)
    del old.__dict__["_task"], old.__dict__["_unreplayed"]
    replay = pickle.loads(pickle.dumps(old))
    assert "_task" not in replay.__dict__ and len(replay) == 1
    seen = {}

    def body() -> None:
        with replay.draw(gen):
            seen["value"] = torch.rand(3, generator=gen)

    in_one_backward(body)
    assert torch.equal(seen["value"], drawn)


def test_under_torch_compile_nothing_is_recorded_and_the_draw_compiles_whole() -> None:
    """Under ``torch.compile`` the draw context records nothing (a generator's state cannot be
    traced): ``fullgraph=True`` compiles and the replay stays empty."""
    gen = torch.Generator().manual_seed(7)
    replay = NoiseReplay(depth=4)

    def f(t: torch.Tensor) -> torch.Tensor:
        with replay.draw(gen):
            return t + 1

    out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and len(replay) == 0


def test_a_forward_draw_starts_a_new_round_even_within_one_backward_pass() -> None:
    """"The next forward starts a new round of records": after a forward draw (here from another
    thread, which is outside the backward pass), the next replay takes the newest record, even
    though this backward pass has already replayed one."""
    gen = torch.Generator().manual_seed(8)
    replay = NoiseReplay(depth=4)
    drawn = forward_draws(replay, gen, 2)
    got: list[torch.Tensor] = []
    newer: list[torch.Tensor] = []

    def body() -> None:
        with replay.draw(gen):
            got.append(torch.rand(3, generator=gen))
        thread = threading.Thread(target=lambda: newer.extend(forward_draws(replay, gen, 1)))
        thread.start()
        thread.join()
        with replay.draw(gen):
            got.append(torch.rand(3, generator=gen))

    in_one_backward(body)
    assert torch.equal(got[0], drawn[1])
    assert torch.equal(got[1], newer[0])
