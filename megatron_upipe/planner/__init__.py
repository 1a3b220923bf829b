"""Memory planner: rank 0's training step simulated at full scale under fake tensors (simulate), plus margins,
kernel workspaces and the max-context search (estimate)."""
