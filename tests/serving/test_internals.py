"""Contract tests: one per item of predictor/server/kserve_internals.py. Each fails with the
item's name when a KServe upgrade changes what that item relies on."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from predictor.serving import internals
from tests.support import REPO


def require(item: str, condition: bool, why: str) -> None:
    if not condition:
        pytest.fail(f"kserve_internals item {item} broke with this KServe: {why}", pytrace=False)


def test_every_item_has_a_contract_test() -> None:
    names = {n for n in globals() if n.startswith("test_item_")}
    assert {f"test_item_{i.lower()}" for i in internals.ITEMS} == names


def test_item_argv_wipe() -> None:
    # kserve.model_server parses argv at import: with our flags left in, it would swallow them
    code = (
        "import sys; sys.argv = ['x', '--http_port', '1234'];"
        "import kserve.model_server as m; print(m.args.http_port)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    require("ARGV_WIPE", out.stdout.strip() == "1234", "kserve.model_server no longer parses argv")
    code = (
        "import sys; sys.argv = ['x', '--port', '1']; "
        "import predictor.__main__ as main; assert 'kserve' not in sys.modules;"
        "main.hide_argv_from_kserve(); import kserve.model_server; print(sys.argv)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    require("ARGV_WIPE", out.stdout.strip() == "['x']", out.stderr[-500:])


def test_item_global_app() -> None:
    from fastapi import FastAPI
    from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING

    require(
        "GLOBAL_APP",
        FASTAPI_APP_IMPORT_STRING == "kserve.model_server:app",
        f"the REST server now serves {FASTAPI_APP_IMPORT_STRING}",
    )
    require("GLOBAL_APP", isinstance(internals.kserve_app(), FastAPI), "no global FastAPI app")


def test_item_exception_handlers() -> None:
    from kserve.protocol.rest.server import RESTServer

    source = inspect.getsource(RESTServer)
    require(
        "EXCEPTION_HANDLERS",
        "def create_application(self)" in source
        and "app.add_exception_handler(Exception, generic_exception_handler)" in source,
        "RESTServer.create_application no longer registers the catch-all handler there",
    )


def test_item_copied_grpc_start() -> None:
    from kserve.protocol.grpc.interceptors import ExceptionToStatusInterceptor
    from kserve.protocol.grpc.server import GRPCServer

    source = inspect.getsource(GRPCServer.start)
    for needed in ("InferenceServicer(", "aio.server(", "add_GRPCInferenceServiceServicer_to_server",
                   "self._server.start()", "wait_for_termination"):  # fmt: skip
        require("COPIED_GRPC_START", needed in source, f"GRPCServer.start lost {needed!r}")
    init = inspect.signature(GRPCServer.__init__).parameters
    require(
        "COPIED_GRPC_START",
        list(init)[1:5] == ["port", "data_plane", "model_repository_extension", "kwargs"],
        f"GRPCServer.__init__ takes {list(init)}",
    )
    init_source = inspect.getsource(GRPCServer.__init__)
    for attr in ("self._port", "self._data_plane", "self._model_repository_extension",
                 "self._server"):  # fmt: skip
        require("COPIED_GRPC_START", attr in init_source, f"GRPCServer no longer sets {attr}")
    require(
        "COPIED_GRPC_START",
        "handle_exception" in vars(ExceptionToStatusInterceptor),
        "ExceptionToStatusInterceptor.handle_exception is gone",
    )


def test_item_rewritten_model_server_start() -> None:
    from kserve import ModelServer

    source = inspect.getsource(ModelServer.start)
    for needed in ("_register_and_check_atleast_one_model_is_ready", "RESTServer(",
                   "self.setup_event_loop()", "self.register_signal_handler()",
                   "asyncio.run(self._serve())", "self.servers.append"):  # fmt: skip
        require("REWRITTEN_MODEL_SERVER_START", needed in source, f"start no longer {needed!r}")
    for name in ("_serve", "setup_event_loop", "register_signal_handler",
                 "_register_and_check_atleast_one_model_is_ready"):  # fmt: skip
        require("REWRITTEN_MODEL_SERVER_START", hasattr(ModelServer, name), f"{name} is gone")
    server = ModelServer(http_port=0, grpc_port=0, enable_grpc=False)
    for attr in ("servers", "dataplane", "model_repository_extension", "http_port",
                 "grace_period", "event_loop", "timeout_keep_alive", "access_log_format",
                 "max_threads"):  # fmt: skip
        require("REWRITTEN_MODEL_SERVER_START", hasattr(server, attr), f"no ModelServer.{attr}")


def test_item_uvicorn_handle_exit() -> None:
    import uvicorn
    from kserve.protocol.rest.server import RESTServer

    rest = RESTServer("kserve.model_server:app", None, None, 0)  # type: ignore[arg-type]
    server = getattr(rest, "_server", None)
    require("UVICORN_HANDLE_EXIT", isinstance(server, uvicorn.Server), "RESTServer._server")
    require("UVICORN_HANDLE_EXIT", hasattr(server, "handle_exit"), "uvicorn.Server.handle_exit")
    require("UVICORN_HANDLE_EXIT", hasattr(rest, "config"), "RESTServer.config")
    seen: list[int] = []
    internals.patch_handle_exit(rest, lambda signum, frame: seen.append(signum))
    server.handle_exit(15, None)  # type: ignore[union-attr]
    require("UVICORN_HANDLE_EXIT", seen == [15], "the patched handler was not called")


def test_item_private_server_attributes() -> None:
    import uvicorn
    from kserve import ModelServer

    server = ModelServer(http_port=0, grpc_port=0, enable_grpc=False)
    require(
        "PRIVATE_SERVER_ATTRIBUTES",
        hasattr(server, "_rest_server") and hasattr(server, "_grpc_server"),
        "ModelServer._rest_server / _grpc_server",
    )
    for attr in ("should_exit", "force_exit"):
        require(
            "PRIVATE_SERVER_ATTRIBUTES",
            attr in inspect.getsource(uvicorn.Server),
            f"uvicorn.Server.{attr}",
        )


async def test_item_repository_extension() -> None:
    from kserve import ModelServer
    from kserve.protocol.grpc.servicer import InferenceServicer

    servicer_source = inspect.getsource(InferenceServicer)
    require(
        "REPOSITORY_EXTENSION",
        "self._mode_repository_extension.load(" in servicer_source
        and 'response["name"]' in servicer_source,
        "the gRPC servicer no longer reads the extension's load() result as a dict",
    )
    server = ModelServer(http_port=0, grpc_port=0, enable_grpc=False)
    extension = internals.GuardedRepositoryExtension(
        server.registered_models, False, lambda name: PermissionError(name)
    )
    internals.install_repository_extension(server, extension)
    require("REPOSITORY_EXTENSION", server.model_repository_extension is extension, "replaced")
    with pytest.raises(PermissionError):
        await extension.unload("m")
