"""`python -m kvsession serve --replicas N --ray-address ADDR|local [--session-dir SHARED]`:
N engine replicas on a Ray cluster behind one OpenAI-compatible ingress (this process).

`--ray-address local` starts a Ray cluster inside this process (stopped with it); any other
address joins a running one (`ray start --head` on one machine, `ray start --address ...` on
the others). Replicas on other nodes listen on their node's address, so give them an
`--api-key` (the ingress forwards the client's key, and uses it for its own calls). All
replicas share --session-dir: it must be one directory every node sees (a shared
filesystem with working flock), or an object store's URL (`s3://bucket/sessions`: each
replica keeps a local directory whose sessions' logs and snapshots are mirrored there,
kvsession/tiers/session_mirror.py), which is how a session resumes on another replica.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
from pathlib import Path

import uvicorn

from kvsession.flags import llm_kwargs
from kvsession.serve.cors import allow_origins
from kvsession.serve.listen import LISTENING, bind_listener
from kvsession.serve.router import Routing


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (the `ray` extra)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve with N engine replicas on Ray (default: one in-process engine)")
    g.add_argument("--ray-address", default=None,
                   help="'local' (a cluster inside this process) or a running cluster's "
                        "address; implies --replicas (default 1)")
    g.add_argument("--ray-num-cpus", type=int, default=None,
                   help="with --ray-address local: CPUs the cluster may use (default: all)")
    g.add_argument("--replica-num-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica")
    g.add_argument("--replica-num-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 with --device cuda/auto on a cluster "
                        "with GPUs, else 0)")
    g.add_argument("--replica-max-restarts", type=int, default=5,
                   help="times Ray restarts a replica whose process died; then it is dropped")
    g.add_argument("--load-bound", type=float, default=1.25,
                   help="no replica takes a request above this multiple of its fair share "
                        "of the requests in flight")
    g.add_argument("--routing", choices=[r.value for r in Routing], default="affinity",
                   help="placement of stateless requests; 'random' is the baseline the "
                        "benchmark measures affinity against (named sessions stay sticky)")
    g.add_argument("--summary-interval-s", type=float, default=1.0,
                   help="how often the ingress asks each replica what it holds")
    g.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="how long a drain waits for a replica's requests in flight")
    g.add_argument("--replica-unresponsive-s", type=float, default=30.0,
                   help="a replica that answers no summary for this long (a hung process) "
                        "is killed and restarted; its sessions resume elsewhere")
    g.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="how long the ingress waits for a replica's answer to a request")
    g.add_argument("--replica-start-timeout-s", type=float, default=300.0,
                   help="how long a replica may take to load the model and listen")


def wants_replicas(args) -> bool:
    return args.replicas is not None or args.ray_address is not None


def _check(p: argparse.ArgumentParser, args) -> None:
    args.replicas = 1 if args.replicas is None else args.replicas
    args.ray_address = args.ray_address or "local"
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    if not args.load_bound >= 1.0:
        p.error(f"--load-bound must be >= 1.0, got {args.load_bound}")
    for name in ("summary_interval_s", "drain_timeout_s", "replica_start_timeout_s",
                 "replica_num_cpus", "replica_unresponsive_s", "request_timeout_s"):
        if not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')} must be > 0 and finite, got "
                    f"{getattr(args, name)}")
    if args.replica_max_restarts < 0:
        p.error(f"--replica-max-restarts must be >= 0, got {args.replica_max_restarts}")
    if args.ray_address != "local" and args.session_dir is None:
        logging.getLogger("kvsession.serve").warning(
            "no --session-dir: a session whose replica is lost starts over on another")


def run_replicated(args, parser: argparse.ArgumentParser, llm_cls) -> int:
    """Serve with replicas until SIGTERM / SIGINT."""
    try:
        import ray
    except ImportError:
        parser.error("--replicas / --ray-address need Ray: pip install 'kvsession[ray]'")
    from kvsession.serve.ray_ingress import Ingress
    from kvsession.serve.ray_replicas import ActorOptions, RayReplicas, ReplicaGone

    _check(parser, args)
    log = logging.getLogger("kvsession.serve")
    sock = bind_listener(args.host, args.port)
    local = args.ray_address == "local"
    ray.init(address=None if local else args.ray_address, include_dashboard=False,
             num_cpus=args.ray_num_cpus if local else None, log_to_driver=True,
             logging_level=logging.WARNING)
    try:
        gpus = args.replica_num_gpus
        if gpus is None:
            gpus = 1.0 if args.device in ("cuda", "auto") and ray.cluster_resources().get(
                "GPU", 0) else 0.0
        kwargs = llm_kwargs(args, llm_cls)
        if args.session_dir is not None and "://" not in args.session_dir:
            kwargs["session_dir"] = str(Path(args.session_dir).resolve())  # (a URL: as is)
        server_kwargs = dict(model_name=args.served_model_name or Path(args.model).name,
                             api_key=args.api_key,
                             max_concurrent=args.max_concurrent_requests,
                             max_conversations=args.max_conversations,
                             default_max_tokens=args.default_max_tokens,
                             aliases=(str(args.model),),
                             session_dir=kwargs.get("session_dir"))
        replicas = RayReplicas(args.replicas, str(Path(args.model).resolve()), kwargs,
                               server_kwargs, "127.0.0.1" if local else "node",
                               ActorOptions(args.replica_num_cpus, gpus,
                                            args.replica_max_restarts),
                               args.log_level, args.replica_start_timeout_s)
        return _serve(args, sock, replicas, Ingress, ReplicaGone, log)
    finally:
        sock.close()
        ray.shutdown()


def _serve(args, sock, replicas, ingress_cls, gone_error, log) -> int:
    ingress = ingress_cls(replicas, args.api_key, args.load_bound, args.summary_interval_s,
                          drain_timeout_s=args.drain_timeout_s,
                          request_timeout_s=args.request_timeout_s,
                          unresponsive_s=args.replica_unresponsive_s,
                          routing=Routing(args.routing))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            await ingress.start()
        except gone_error as e:
            log.error("a replica did not start: %s", e)
            raise
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"{LISTENING} http://{shown}:{port} ({args.replicas} replicas)", flush=True)
        yield
        ingress.accepting = False
        await ingress.close()  # stops the replicas: they persist their named sessions

    app = ingress.app()
    allow_origins(app, args.allowed_origins)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(max(1, args.shutdown_timeout_s)))
    uv = uvicorn.Server(config)
    previous = signal.signal(signal.SIGTERM, lambda *_: uv.handle_exit(signal.SIGTERM, None))
    try:
        uv.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not uv.started:
        return 1
    print("kvsession serve: stopped", flush=True)
    return 0

