"""The file that names a pool's page geometry in its disk directory, so that a restarted
node re-opens the pools its disk holds (NodeStore.recover_disk)."""

from __future__ import annotations

import json
import os

from cluster.core.geometry import PageGeometry
from cluster.core.tiers.aligned import write_private_text

POOL_FILE = "pool.json"


def write_pool_file(path: str, geometry: PageGeometry) -> None:
    write_private_text(os.path.join(path, POOL_FILE),
                       json.dumps({"shape": list(geometry.shape), "dtype": geometry.dtype}))


def read_pool_file(path: str) -> PageGeometry | None:
    try:
        with open(os.path.join(path, POOL_FILE)) as handle:
            data = json.load(handle)
        return PageGeometry(tuple(data["shape"]), data["dtype"])
    except (OSError, ValueError, KeyError):
        return None
