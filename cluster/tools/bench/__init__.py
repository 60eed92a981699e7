"""Benchmarks run by `raykv bench NAME`; each writes JSON with a top-level "ratios" object."""
