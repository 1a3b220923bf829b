"""The memory switches through the entry point: pretrain_llama.main() on 2 gloo ranks (tiny Llama, UPipe over cp=2,
shipped corpus), 4 steps of 4 accumulation steps with an evaluation, once plain and once with
every memory switch on (the paper's stack): full recompute with the layer inputs offloaded to the host, model states
fully sharded over the CP ranks (ZeRO-3), sequence-tiled MLP and chunked loss. Every step's loss, the gradient norm
and the evaluation loss are equal (float32, rtol 1e-5)."""

from __future__ import annotations

import pytest

from tests.dist_helper import run_on_ranks
from tests.train_harness import SMALL, read_metrics, run_main

STEPS = 4
SWITCHES = ["memory.recompute=full", "memory.offload_checkpoints=true", "memory.shard_model_states=true",
            "memory.mlp_chunks=2", "memory.loss_chunks=2"]


def _job(rank, world_size, tmp):
    from megatron_upipe.memory_switches import offload, sharding

    calls = {"to_host": 0, "wrap_fully_sharded": 0}  # spies: the switches must reach the training job

    def spy(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    common = [*SMALL, f"train.steps={STEPS}", "train.eval_interval=4", "train.eval_iters=1"]
    plain = run_main(*common, f"log.metrics_file={tmp}/plain.jsonl")
    assert calls == {"to_host": 0, "wrap_fully_sharded": 0}
    spy(offload.HostOffloader, "to_host")
    spy(sharding, "wrap_fully_sharded")
    switched = run_main(*common, *SWITCHES, f"log.metrics_file={tmp}/switches.jsonl")
    return plain, switched, calls


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory_switches")
    for rank, (*runs, calls) in enumerate(run_on_ranks(_job, 2, str(tmp))):
        for code, err in runs:
            assert code == 0, f"rank {rank}: exit {code}\n{err}"
        # one wrap; the 2 layers' inputs of 4 micro-batches per training step (evaluation offloads nothing)
        assert calls == {"wrap_fully_sharded": 1, "to_host": STEPS * 4 * 2}, calls
    return tmp


def test_switches_train_the_same_model(run):
    for kind, keys in (("train", ("loss", "grad_norm")), ("eval", ("loss",))):
        plain, switched = read_metrics(run / "plain.jsonl", kind), read_metrics(run / "switches.jsonl", kind)
        assert [r["step"] for r in plain] == [r["step"] for r in switched] and plain
        for a, b in zip(plain, switched):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=1e-5), (kind, k, a["step"], a[k], b[k])
