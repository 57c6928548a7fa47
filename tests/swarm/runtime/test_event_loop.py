"""The processes' event loops (`swarm.runtime.aio`): uvloop where installed unless a flag or `SWARMGATE_EVENT_LOOP`
says asyncio; the gateway's and server's `--event_loop` flags checked; the client loop and `run_main` on the choice."""
from __future__ import annotations

import asyncio

import pytest
import uvloop

from gateway.config import GatewayConfig
from server.config import ServerConfig
from swarm.runtime import aio
from swarm.runtime.config import ConfigError, build_parser, load_config


@pytest.fixture(autouse=True)
def _no_choice(monkeypatch):
    monkeypatch.setattr(aio, "_chosen", None)
    monkeypatch.delenv(aio.LOOP_ENV, raising=False)


def _loop_of(factory) -> str:
    loop = factory()
    try:
        return type(loop).__module__.split(".")[0]
    finally:
        loop.close()


def test_the_choice_comes_from_use_loop_then_the_environment_then_auto(monkeypatch):
    assert _loop_of(aio.loop_factory()) == "uvloop"  # auto: installed
    monkeypatch.setenv(aio.LOOP_ENV, "asyncio")
    assert _loop_of(aio.loop_factory()) == "asyncio"
    aio.use_loop("uvloop")  # a process's flag over the environment
    assert _loop_of(aio.loop_factory()) == "uvloop"
    assert _loop_of(aio.loop_factory("asyncio")) == "asyncio"
    monkeypatch.setenv(aio.LOOP_ENV, "tokio")
    monkeypatch.setattr(aio, "_chosen", None)
    with pytest.raises(ValueError, match="unknown event loop 'tokio': use auto, uvloop or asyncio"):
        aio.loop_factory()
    monkeypatch.setattr(aio, "_uvloop", lambda: None)  # where uvloop is not installed
    assert _loop_of(aio.loop_factory("auto")) == "asyncio"
    with pytest.raises(ValueError, match="uvloop is not installed"):
        aio.parse_event_loop("uvloop")


def test_run_main_runs_a_coroutine_on_the_chosen_loop():
    async def kind() -> type:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop())

    assert aio.run_main(kind()) is uvloop.Loop
    assert issubclass(aio.run_main(kind(), "asyncio"), asyncio.BaseEventLoop)
    with pytest.raises(ZeroDivisionError):  # the coroutine's own error, as asyncio.run
        aio.run_main(_fails())


async def _fails() -> None:
    raise ZeroDivisionError


@pytest.mark.parametrize("config_class", [GatewayConfig, ServerConfig])
def test_the_event_loop_flag_is_checked(config_class):
    assert "uvloop" in config_class.model_fields["event_loop"].description
    args = build_parser(config_class, "p", "", positional="model").parse_args(["m", "--event_loop", "ASYNCIO"])
    assert load_config(config_class, args, environ={}).event_loop == "asyncio"
    assert load_config(config_class, build_parser(config_class, "p", "", positional="model").parse_args(["m"]),
                       environ={"SWARMGATE_EVENT_LOOP": "uvloop"}).event_loop == "uvloop"
    bad = build_parser(config_class, "p", "", positional="model").parse_args(["m", "--event_loop", "trio"])
    with pytest.raises(ConfigError, match="event_loop.*use auto, uvloop or asyncio"):
        load_config(config_class, bad, environ={})
