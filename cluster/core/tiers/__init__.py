"""Tiers: fixed-size slot arenas (device, host shared memory, disk slabs). Pure: no Ray."""
