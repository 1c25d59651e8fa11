"""`dspark serve`: the OpenAI-compatible server under uvicorn, with graceful SIGTERM handling."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from dspark.config import SERVE_DECODE_STALL_MS


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT."""
    import uvicorn

    from dspark.cli import engine_config
    from dspark.server.app import create_app
    from dspark.server.runner import GracefulServer

    config = engine_config(args, default_policy="load-aware")
    config.validate()  # fail before binding the port
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)")
    if args.tool_call_parser is not None:
        from dspark.server.tool_parsers import make_parser

        make_parser(args.tool_call_parser)  # an unknown name fails before the model loads
        if not args.enable_auto_tool_choice:
            print("warning: --tool-call-parser has no effect without --enable-auto-tool-choice", file=sys.stderr)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or None
    app = create_app(config, served_model_name=args.served_model_name, api_key=api_key,
                     max_queue=args.max_queue, shutdown_timeout=args.shutdown_timeout,
                     allowed_origins=args.allowed_origins,
                     tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                     replica_name=args.replica_name or os.environ.get("DSPARK_REPLICA_NAME") or None)
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                               timeout_graceful_shutdown=args.shutdown_timeout)
    failed = None
    try:
        GracefulServer(uv_config, app.state.dspark).run()
    except SystemExit as e:  # uvicorn could not bind (a host that does not resolve, a port in use)
        failed = e.code if isinstance(e.code, int) and e.code else 1
    if app.state.dspark.status == "loading":
        # Stopped while the engine still loads: interpreter shutdown would tear torch down under
        # the loading thread (the process aborts), so leave now; the load writes its caches atomically.
        log = logging.getLogger("dspark.server")
        if failed is None:
            log.info("stopped while the engine was loading")
        else:
            log.error("could not start serving on %s:%s (see the error above); exiting", args.host, args.port)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(failed or 0)
    if failed is not None:
        return failed
    return 1 if app.state.dspark.load_error or app.state.dspark.fatal else 0


def add_serve_parser(subparsers: argparse._SubParsersAction,
                     add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `serve` subcommand to the `dspark` command line."""
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.set_defaults(max_decode_stall_ms=SERVE_DECODE_STALL_MS)  # the offline commands keep no bound
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DSPARK_API_KEY)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond --max-num-seqs before answering 429")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model's name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--allowed-origins", nargs="*", default=["*"],
                   help="browser origins allowed by CORS (default: any; none: CORS off)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model writes tool calls in its own format')
    p.add_argument("--tool-call-parser", default=None, metavar="{hermes,llama3_json}",
                   help="that format (hermes: <tool_call>{...}</tool_call>, as Qwen2.5/Qwen3 write; "
                        "llama3_json: bare {\"name\", \"parameters\"} objects, as Llama 3.1-3.3 write)")
    p.add_argument("--replica-name", default=None,
                   help="label every metric replica=NAME, for several servers behind one endpoint "
                        "(default: $DSPARK_REPLICA_NAME; none: no label)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
