"""Fixtures of the server tests (helpers in serve_helpers.py)."""
import signal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serve_helpers import Server, make_chat_model  # noqa: E402


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """The embedded model with a ChatML chat template in tokenizer_config.json."""
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def start_server():
    servers = []

    def start(*args, **kw):
        s = Server(list(args), **kw)
        servers.append(s)
        return s
    yield start
    for s in servers:
        s.stop(signal.SIGKILL)
