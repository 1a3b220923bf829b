"""Memory accounting: what a step's memory is, measured and modelled (the planner and the training log use both).

tracker.py          PeakMemoryTracker: a storage-tracking dispatch mode, byte-exact live/peak bytes on CPU and fake
                    CUDA tensors, by category
attention_model.py  the closed-form peak of one attention op (forward + backward) per CP strategy
measure.py          one attention op run under the tracker, for the model's tests and the benchmarks

Neighbours: memory_switches/ (what changes memory: offload, recompute, sharding, the host budget) and planner/
(a whole training step simulated at full scale with both).
"""
