"""Creating the service's actors: the directory shards, the controller and the control loop.

Creation lives here, not in actors/handles.py: the actor classes import the handles to call
each other, so the handles must not import the actor classes back. Node actors are created
by the controller, through actors/spawn_node.py.
"""

from __future__ import annotations

from actors.control_loop import ControlLoop
from actors.controller import Controller
from actors.directory import DirectoryShard
from actors.handles import (
    CONTROL_LOOP_NAME,
    CONTROLLER_NAME,
    DIRECTORY_NAME,
    ControllerHandle,
    ControlLoopHandle,
    DirectoryHandle,
)
from actors.spawn_node import detached_options
from cluster.core.config import CacheConfig


def spawn_directory(config: CacheConfig) -> DirectoryHandle:
    """The running shards, or new ones (named, detached); returns without waiting."""
    config_json = config.model_dump_json()
    return DirectoryHandle([
        DirectoryShard.options(**detached_options(DIRECTORY_NAME.format(shard=i), config)
                               ).remote(config_json, i)
        for i in range(config.num_directory_shards)])


def spawn_controller(config: CacheConfig) -> ControllerHandle:
    """The running controller, or a new one (named, detached)."""
    return ControllerHandle(Controller.options(**detached_options(CONTROLLER_NAME, config)
                                               ).remote(config.model_dump_json()))


def spawn_control_loop(config: CacheConfig, policy=None,
                       name: str = CONTROL_LOOP_NAME) -> ControlLoopHandle:
    """The running loop of that name, or a new one (named, detached) with `policy`
    (a callable decide(snapshot, state, now_s); None: policies/rebalance.py)."""
    return ControlLoopHandle(ControlLoop.options(**detached_options(name, config)
                                                 ).remote(config.model_dump_json(), policy))
