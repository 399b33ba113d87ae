"""`kvtool serve`: an OpenAI-compatible HTTP server over the engine, with KV metrics."""

import contextlib
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.commands import render
from kvtool.commands.engine_build import open_engine
from kvtool.commands.options import with_engine_options
from kvtool.engine.errors import ConfigError, WorkerError
from kvtool.engine.params import EngineParams

# After SIGINT/SIGTERM, requests in flight get this long to finish; the rest are aborted.
GRACEFUL_SHUTDOWN_S = 2.0
# uvicorn cancels what is still running this much later (the engine loop's aborts normally end it first).
_UVICORN_SHUTDOWN_BACKSTOP_S = 5.0
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@with_engine_options
def serve(
    model_tag: Annotated[
        Optional[str], typer.Argument(metavar="MODEL", help="Model directory, as `vllm serve MODEL` (or --model).")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: a free port, shown when ready).")] = 8000,
    served_model_name: Annotated[
        Optional[list[str]],
        typer.Option(
            "--served-model-name", help="The name clients put in `model` (repeat for aliases). Default: the --model value."
        ),
    ] = None,
    api_key: Annotated[
        Optional[str],
        typer.Option("--api-key", envvar="KVTOOL_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 routes."),
    ] = None,
    chat_template: Annotated[
        Optional[str],
        typer.Option("--chat-template", help="Chat template: a file path, or the template text itself."),
    ] = None,
    generation_config: Annotated[
        str,
        typer.Option("--generation-config", help="Request defaults: auto (the model's generation_config.json), "
                     "vllm (none), or a directory holding a generation_config.json."),
    ] = "auto",
    enable_log_requests: Annotated[
        bool, typer.Option("--enable-log-requests", help="Log each request's id, prompt length and sampling.")
    ] = False,
    enable_auto_tool_choice: Annotated[
        bool, typer.Option("--enable-auto-tool-choice", help="Read tool calls from the model's output (tool_choice "
                           "auto, required or a named function); needs --tool-call-parser.")
    ] = False,
    tool_call_parser: Annotated[
        Optional[str],
        typer.Option("--tool-call-parser", help="The model's tool-call format: hermes (Qwen2.5, Qwen3, Hermes), "
                     "llama3_json or llama4_json."),
    ] = None,
    uvicorn_log_level: Annotated[
        str, typer.Option("--uvicorn-log-level", help="critical, error, warning, info, debug or trace.")
    ] = "info",
    *,
    engine: EngineParams,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), /health and /metrics.

    Prints one line on stderr with the URL once it accepts requests.

    SIGINT or SIGTERM stops it: requests in flight get a moment to finish, the rest are aborted,
    and pending KV stores are written.

    Examples:

    \b
      kvtool serve
      kvtool serve DIR --port 8001 --served-model-name qwen3 --api-key secret
      kvtool serve --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'
      kvtool serve QWEN_DIR --enable-auto-tool-choice --tool-call-parser hermes
    """
    import uvicorn

    from kvtool.server.app import create_app
    from kvtool.server.context import ServerSettings
    from kvtool.server.sampling import load_generation_defaults

    if uvicorn_log_level not in UVICORN_LOG_LEVELS:
        raise ConfigError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got {uvicorn_log_level!r}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be between 0 and 65535, got {port}")
    if api_key is not None and not api_key:
        raise ConfigError("--api-key must not be empty")
    template_text = _read_chat_template(chat_template) if chat_template is not None else None
    if generation_config not in ("auto", "vllm") and not Path(generation_config).is_dir():
        raise ConfigError(f"--generation-config must be auto, vllm or a directory, got {generation_config!r}")
    _refuse_tool_flags(enable_auto_tool_choice, tool_call_parser)
    _log_to_stderr(uvicorn_log_level)
    # Bind before loading the model, so a taken port fails at once; listen only once it is loaded.
    sock = _bind(host, port)
    try:
        with open_engine(engine) as llm:
            from kvtool.engine.presets.default_model import DEFAULT_MODEL_NAME

            model = engine.model if engine.model is not None else DEFAULT_MODEL_NAME
            settings = ServerSettings(
                served_model_names=served_model_name or [model], model_root=model, api_key=api_key,
                generation_defaults=load_generation_defaults(generation_config, llm.model_dir.generation_config),
                log_requests=enable_log_requests, tool_call_parser=tool_call_parser,
                enable_auto_tool_choice=enable_auto_tool_choice,
            )
            tokenizer = llm.tokenizer.with_chat_template(template_text) if template_text is not None else None
            url = _url(sock)
            server: uvicorn.Server | None = None
            app = create_app(
                llm, settings, tokenizer=tokenizer,
                on_ready=lambda: render.info(f"kvtool serve ready at {url}"),
                shutdown_requested=lambda: server is not None and server.should_exit,
                grace_s=GRACEFUL_SHUTDOWN_S,
            )
            config = uvicorn.Config(
                app, log_level=uvicorn_log_level, log_config=_uvicorn_log_config(), lifespan="on",
                timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S + _UVICORN_SHUTDOWN_BACKSTOP_S),
            )
            server = _draining_server(config)
            lost_workers: list[WorkerError] = []

            def engine_failed(e: BaseException) -> None:
                # Without its tensor-parallel workers the engine can serve nothing: stop serving.
                if isinstance(e, WorkerError):
                    lost_workers.append(e)
                    server.should_exit = True

            app.state.engine_loop.on_engine_failed = engine_failed
            sock.listen(2048)
            try:
                server.run(sockets=[sock])
            finally:
                # Normally done at lifespan shutdown already; a forced exit (second Ctrl-C) skips that.
                app.state.engine_loop.shutdown()
            if lost_workers:
                raise lost_workers[0]
    finally:
        sock.close()


def _draining_server(config):
    """A uvicorn.Server whose SIGINT/SIGTERM start the graceful drain and end with exit status 0.

    uvicorn re-raises the captured signal once it has shut down (exit 130/143); a clean drain
    is a normal end, so this server only records the signal.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return DrainingServer(config)


def _refuse_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's checks of the tool flags; kvtool checks the parser's name even without auto tool choice."""
    from kvtool.server.tool_parsers import TOOL_CALL_PARSERS

    if enable_auto_tool_choice and not tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"invalid tool call parser: {tool_call_parser} (choose from {', '.join(TOOL_CALL_PARSERS)})")


def _read_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's text, or the argument itself when it looks like a template."""
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value}: cannot be read ({e})") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and it does not look like a template")


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} cannot be resolved: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_log_config() -> dict:
    """uvicorn's logging setup with the access log on stderr too: stdout carries only data."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _log_to_stderr(uvicorn_level: str) -> None:
    """kvtool's own loggers (engine loop, connectors) write to stderr beside uvicorn's."""
    logger = logging.getLogger("kvtool")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel("DEBUG" if uvicorn_level == "trace" else uvicorn_level.upper())
