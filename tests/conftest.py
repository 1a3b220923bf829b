"""Session-wide test set-up.

torch is imported here, at collection: on import it binds its log handler to the sys.stderr of that moment, and a
module whose first `import torch` happened inside a test with capsys would leave that handler writing to the test's
capture stream, closed after the test ("Logging error ... I/O operation on closed file" in a later test's output).

The slowest modules first: tools/test.sh runs the suite on two xdist workers, a module on one of them, taken in
collection order; alphabetical order put the long training modules last, and one worker ran them alone for minutes
while the other had finished. SLOW_FIRST is ordered by their time in `--durations` of a full run (about 25-55 s of
setup or call each); a module not listed keeps its place after them.
"""

import torch  # noqa: F401

SLOW_FIRST = (
    "test_fastest", "test_train_equivalence", "test_recipes", "test_planner_fsdp", "test_fastest_layouts",
    "test_sharded_states",
    "test_auto_stack", "test_llama_layouts", "test_cuda_contracts", "test_resume_semantics", "test_hybrid_training",
    "test_train_smoke", "test_planner_depth", "test_fsdp_checkpoint", "test_offload_recompute", "test_hf_parity",
    "test_checkpoint_resume", "test_attention_overlap", "test_train_metrics", "test_hf_train", "test_planner",
    "test_document_mask", "test_checkpoint_faults",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FIRST)))  # stable: the rest keep their order
