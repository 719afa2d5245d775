"""`kimi-service serve`: plan, start vLLM as a child, tell systemd when it can really answer.

READY=1 goes out only once /health answers 200 and /v1/models lists the served name; WATCHDOG=1
only while /health keeps answering, so systemd restarts a hung engine. On SIGTERM, serve's own /ready
(serve.ready_port, what load balancers check) turns 503 at once; vLLM keeps serving for
serve.withdraw_delay while the balancers take the node out, then until the requests in flight are done
(at most serve.drain_timeout); only then does vLLM get its SIGTERM (it drains whatever is left for its
--shutdown-timeout), and serve exits 0. An engine that dies on its own makes serve exit non-zero with
the engine's status in the journal.

Several nodes, one engine (config `cluster`): systemd cannot order units across hosts, so the nodes
watch each other over HTTP. A follower runs vLLM headless and answers /health on the API port while its
engine runs; its READY=1 means exactly that, so the play can start every follower before the leader.
The leader starts its engine only once every follower answers, and fails (its start, or later the
running unit) when a follower stops answering or comes back as a new instance: vLLM's own /health
keeps answering 200 on the leader after a follower died, until a request fails.

Without systemd (supervisord on a container rental): `serve --env-file --user` reads the secrets and drops
root itself, serve.watchdog_sec stands in for WatchdogSec=, and vLLM dies with serve (PR_SET_PDEATHSIG, a
guard that kills the engine's group once serve is gone, a leftover group killed at the next start), where no
cgroup would catch it.

Modules: `launch` (plan -> the engine's argv and environment, plan.json), `engine` (the child process and
its API), `supervisor` (the main loop), `follower` (a follower node's loop), `cluster` (rendezvous and the
nodes' watch on each other), `status` (the /ready and follower /health pages), `process` (the engine dies
with serve; leftover groups), `output` (vLLM's output passed through, the cause of a failed start),
`sockets` (requests not yet read by vLLM, for the drain), `identity` (--env-file, --user).
"""

from kimi_service.errors import EngineFailed
from kimi_service.launcher.cluster import (
    FOLLOWER_MISSES,
    FollowerStatus,
    FollowerWatch,
    cluster_env,
    cluster_flags,
    connected_to,
    interface_addresses,
    joined,
)
from kimi_service.launcher.engine import (
    EngineApi,
    EngineProcess,
    Pace,
    describe_exit,
    kv_tokens_from_metrics,
    requests_in_flight,
    watchdog_interval,
)
from kimi_service.launcher.launch import (
    API_SERVER_MODULE,
    HEADLESS_MODULE,
    LOAD_TRACKING_FLAG,
    Launch,
    discover,
    engine_argv,
    engine_env,
    prepare,
    vllm_version,
    write_plan,
)
from kimi_service.launcher.status import Readiness, status_server
from kimi_service.launcher.supervisor import Supervisor, serve

__all__ = [
    "API_SERVER_MODULE",
    "FOLLOWER_MISSES",
    "HEADLESS_MODULE",
    "LOAD_TRACKING_FLAG",
    "EngineApi",
    "EngineFailed",
    "EngineProcess",
    "FollowerStatus",
    "FollowerWatch",
    "Launch",
    "Pace",
    "Readiness",
    "Supervisor",
    "cluster_env",
    "cluster_flags",
    "connected_to",
    "describe_exit",
    "discover",
    "engine_argv",
    "engine_env",
    "interface_addresses",
    "joined",
    "kv_tokens_from_metrics",
    "prepare",
    "requests_in_flight",
    "serve",
    "status_server",
    "vllm_version",
    "watchdog_interval",
    "write_plan",
]
