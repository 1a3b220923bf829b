"""Benchmarks that check numerics before they time anything."""
