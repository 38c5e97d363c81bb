"""The lm-routers model across processes: 2 gloo ranks (ExpertParallelMoE + DDP) reproduce the
single-process loss curve, and the routelab-MoE form computes what the patch_moe form does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from routelab.experiments.lm_routers.data import CharCorpus  # noqa: E402
from routelab.experiments.lm_routers.model import Settings, build_model  # noqa: E402
from routelab.experiments.lm_routers.parallel import (  # noqa: E402
    build_routelab_model,
    clip_grad_norm,
    expert_parallel,
    train_steps,
)
from routelab.parallel import ExpertParallelMoE, run_workers  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="torch.distributed with gloo is needed")]

TINY = Settings(seeds=(0,), steps=4, batch=4, seq=16, d_model=16, layers=2, heads=2, experts=4, unit_hidden=8,
                warmup=2, clip=0.2, threads=1)  # clip: small enough that the global-norm clipping acts
STEPS = 4
#: every router of the experiment (the no-loss ablation is noisy top-2 again)
ROUTERS = ("top1_switch", "top2", "noisy_top2", "batchwise", "base", "sinkhorn", "gm_iw", "dense")


def _corpus() -> CharCorpus:
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 12, (4000,), generator=g)
    return CharCorpus([chr(97 + i) for i in range(12)], {"train": stream, "val": stream, "test": stream},
                      {"train": ["A"], "val": ["A"], "test": ["A"]})


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(20_000)


def _parallel_worker(rank: int, world: int) -> dict[str, list[float]]:
    corpus = _corpus()
    out = {}
    for name in ROUTERS:
        model = expert_parallel(build_routelab_model(TINY.spec(name), TINY, corpus.vocab, 0, _gen()))
        moes = [m for m in model.module.modules() if isinstance(m, ExpertParallelMoE)]
        assert len(moes) == TINY.layers and all(m.local_experts * world == m.num_experts for m in moes)
        out[name] = train_steps(model, TINY, corpus, STEPS, 0, rank=rank, world=world)
    return out


def test_two_gloo_ranks_match_the_single_process_loss_curve() -> None:
    corpus = _corpus()
    ranks = run_workers(_parallel_worker, 2, timeout=120)
    assert ranks[0] == ranks[1]  # every rank reports the same global loss
    for name in ROUTERS:
        single = train_steps(build_routelab_model(TINY.spec(name), TINY, corpus.vocab, 0, _gen()), TINY, corpus,
                             STEPS, 0)
        got = ranks[0][name]
        assert len(got) == STEPS and single[0] != single[-1]  # it trains
        assert max(abs(a - b) for a, b in zip(got, single)) < 1e-4, (name, got, single)


def _grads(model: torch.nn.Module, corpus: CharCorpus, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor]:
    """Gradients of one step (this rank's share of the first batch; loss = mean CE + aux)."""
    from routelab.routing import aux_loss

    module = getattr(model, "module", model)
    offsets = corpus.train_batches(1, TINY.batch, TINY.seq, torch.Generator().manual_seed(10_000))
    share = TINY.batch // world
    w = corpus.windows(offsets[0, rank * share:(rank + 1) * share], TINY.seq)
    logits = model(input_ids=w[:, :-1]).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    (ce + aux_loss(module)).backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    grads["global norm"] = torch.tensor(clip_grad_norm(model, float("inf")))  # the norm clipping sees
    return grads


def _grad_worker(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    corpus = _corpus()
    return {name: _grads(expert_parallel(build_routelab_model(TINY.spec(name), TINY, corpus.vocab, 0, _gen())),
                         corpus, rank, world) for name in ROUTERS}


def test_two_gloo_ranks_give_the_single_process_gradients() -> None:
    """DDP averages the replicated gradients, the hook scales the sharded experts': together the
    single-process gradient of mean CE + aux on the global batch, parameter by parameter."""
    corpus = _corpus()
    ranks = run_workers(_grad_worker, 2, timeout=120)
    for name in ROUTERS:
        want = _grads(build_routelab_model(TINY.spec(name), TINY, corpus.vocab, 0, _gen()), corpus)
        for rank, got in enumerate(ranks):
            got = got[name]
            assert set(got) == set(want), (name, set(want) ^ set(got))
            for param, g in got.items():
                ref = want[param]
                if ".moe.experts." in param:  # this rank's shard of the experts
                    n = ref.shape[0] // 2
                    ref = ref[rank * n:(rank + 1) * n]
                torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-4, msg=f"{name} rank {rank} {param}")
            assert float(got["global norm"]) > TINY.clip  # so the loss-curve test exercises the clipping


@pytest.mark.parametrize("name", ["top2", "base", "gm_iw", "batchwise", "dense"])
def test_routelab_moe_form_computes_what_patch_moe_does(name: str) -> None:
    """Same seed, same batch: the routelab-MoE model's logits and aux losses equal the patch_moe model's."""
    from routelab.routing import aux_loss

    corpus = _corpus()
    patched = build_model(TINY.spec(name), TINY, corpus.vocab, 0, generator=_gen())
    native = build_routelab_model(TINY.spec(name), TINY, corpus.vocab, 0, _gen())
    x = torch.randint(0, corpus.vocab, (4, TINY.seq), generator=torch.Generator().manual_seed(3))
    for mode in ("train", "eval"):
        getattr(patched, mode)()
        getattr(native, mode)()
        a, b = patched(input_ids=x).logits, native(input_ids=x).logits
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(aux_loss(native), aux_loss(patched), atol=1e-6, rtol=1e-5)
