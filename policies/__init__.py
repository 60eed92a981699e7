"""Policies: pure functions and small state machines. No Ray, no I/O."""
