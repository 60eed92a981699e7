"""The pure core: geometry, keys, tiers, pools, the directory index, codecs. No Ray."""
