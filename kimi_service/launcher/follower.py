"""A follower node of a cluster: its engine runs headless, and /health on the API port tells the leader so."""

from __future__ import annotations

import logging

from kimi_service.config import ClusterConfig, Config
from kimi_service.errors import EngineFailed
from kimi_service.launcher.cluster import FollowerStatus, joined
from kimi_service.launcher.engine import EngineProcess, Pace
from kimi_service.launcher.status import status_server
from kimi_service.sdnotify import Notifier

# serve's journal lines carry one name, whichever of its modules writes them.
log = logging.getLogger(__package__)


def run_follower(config: Config, engine: EngineProcess, notifier: Notifier, pace: Pace) -> int:
    """Headless engine plus the /health the leader watches; READY once both are up."""
    cluster = config.cluster
    assert cluster is not None
    status = FollowerStatus(cluster)
    try:
        server = status_server(config.api.host, config.api.port, "/health", status.document,
                               "a follower node serves no API; ask the leader")
    except OSError as exc:
        raise EngineFailed(f"cannot answer /health on {config.api.host}:{config.api.port} for the "
                           f"leader: {exc.strerror}", 1) from None
    try:
        engine.spawn()
        assert engine.child is not None
        status.engine_pid = engine.child.pid
        engine.check()
        notifier.notify(READY=1, STATUS=f"follower (node {cluster.node_rank}): engine running, "
                        f"waiting for the leader at {_master(cluster)}")
        _follow(cluster, engine, notifier, pace)
    except EngineFailed as exc:
        status.engine_exit = str(exc)
        raise
    finally:
        if engine.child is not None:
            engine.stop()
        server.shutdown()
        server.server_close()
    return 0


def _master(cluster: ClusterConfig) -> str:
    return f"{cluster.master_addr}:{cluster.master_port}"


def _follow(cluster: ClusterConfig, engine: EngineProcess, notifier: Notifier, pace: Pace) -> None:
    """Until serve stops: the engine must keep running and, once it joined the leader's group, stay in it."""
    master = _master(cluster)
    member = False
    while not engine.stopping.is_set():
        engine.check()
        now = joined(cluster, data_parallel="--data-parallel-address" in engine.launch.argv)
        if member and not now:
            # vLLM's headless workers outlive a dead leader (measured: they log the broken
            # connection and wait); a restarted leader could never form a group with them.
            raise EngineFailed(f"left the group: the leader's rendezvous at {master} closed (the leader "
                               "stopped or failed); exiting so a fresh engine can join the next one", 1)
        if now != member:
            member = now
            engine.ready = engine.ready or now  # an exit from now on is a failure, not a failed start
            state = f"joined the group at {master}" if now else f"waiting for the leader at {master}"
            notifier.notify(STATUS=f"follower (node {cluster.node_rank}): {state}")
            log.info("follower: %s", state)
        if pace.watchdog:
            notifier.notify(WATCHDOG=1)
        engine.stopping.wait(pace.interval)
