"""`tools/estimate_memory.py --fastest --tp-sizes/--ring-sizes`: the search over layouts (planner/fastest.py
`search_layouts`), for the tiny shape of tests/test_fastest.py at one device size: tp 1 (cp 2), tp 2 (cp 1, sequence
parallelism) and a ring of 2 (parallel.cp_ring), each searched alone and all together (tp 2 with a ring of 2 leaves
cp 1 and is refused). Apart from test_fastest.py so that the two run on different workers.
"""

from __future__ import annotations

import pytest

from tests.dist_helper import run_on_ranks
from tests.test_fastest import CONFIG, GIB, SEQ, SHAPE, VOCAB

LAYOUT_GIB = 0.05


def _job(rank, world_size):
    import torch.distributed as dist

    import megatron_upipe.planner.fastest as fastest
    from megatron_upipe.planner.devices import Margins
    from megatron_upipe.planner.estimate import ConfigSource, estimate
    from megatron_upipe.planner.step_time import HARDWARE

    dist.destroy_process_group()  # the planner makes its own fake one
    plans = {}

    def planned(source, world, vocab, strategy, seq, gpu_mem_bytes, margins, jobs=1, memo=None):
        key = (source.overrides, strategy)  # every plan once, shared by the searches
        if key not in plans:
            plans[key] = estimate(source, world, vocab, strategy, seq, gpu_mem_bytes, margins, jobs=jobs)
        return plans[key]

    fastest.estimate = planned
    return _layouts(fastest, ConfigSource(CONFIG, SHAPE), HARDWARE["h100-80gb"], Margins(0, 0, 0.0))


def _layouts(fastest, source, hw, none) -> dict:
    """search_layouts over tp 1, 2 x ring 1, 2 at LAYOUT_GIB (tp 2 with a ring of 2 leaves cp 1: refused), and each
    layout's own search."""
    from megatron_upipe.planner.estimate import ConfigSource

    gpu = int(LAYOUT_GIB * GIB)
    both = fastest.search_layouts(source, 2, VOCAB, SEQ, gpu, none, hw, (1, 2), (1, 2))
    alone = {}
    for tp, ring in ((1, 1), (2, 1), (1, 2)):
        layout = fastest.layout_overrides(source.load(), tp, ring)
        f = fastest.search_fastest(ConfigSource(CONFIG, (*SHAPE, *layout)), 2, VOCAB, SEQ, gpu, none, hw)
        alone[(tp, ring)] = (layout, f.best.overrides, f.best.seconds, len(f.tried))
    return {"best": (both.best.overrides, both.best.seconds), "tried": len(both.tried),
            "baseline": both.baseline.overrides, "alone": alone}


@pytest.fixture(scope="module")
def searched():
    return run_on_ranks(_job, 1)[0]


def test_search_over_layouts_takes_the_fastest(searched):
    """tp 1 (cp 2), tp 2 (cp 1, sequence parallelism) and a ring of 2 (cp_ring 2), each searched alone:
    search_layouts returns the fastest one's choice with its layout's overrides in front, and plans what the three
    searches plan (tp 2 with a ring of 2 is refused: cp 1)."""
    got = searched
    alone = got["alone"]
    _, (layout, overrides, seconds, _) = min(alone.items(), key=lambda kv: kv[1][2])
    assert got["best"] == ((*layout, *overrides), seconds)
    assert got["tried"] == sum(a[3] for a in alone.values())
    assert got["baseline"] == ()  # the config as given
    assert alone[(2, 1)][0] == ("parallel.tp=2", "parallel.cp=1", "parallel.cp_ring=1",
                                "parallel.sequence_parallel=true")
    assert len({a[2] for a in alone.values()}) == 3  # the three layouts are priced differently
    assert not any("memory.upipe_overlap=true" in o or "=outputs" in o for o in alone[(1, 2)][1])  # ring: serial
