"""The light gateway stack (tests/support/light_gateway.py): started by the first test that asks for it and
stopped after the last test of the test_gw_* modules (which run one after another), so it starts once."""

from __future__ import annotations

import pytest

from tests.support.light_gateway import LightStack, start_light_stack, stop_light_stack

_LIGHT: LightStack | None = None


@pytest.fixture
def light_stack(tmp_path_factory) -> LightStack:
    global _LIGHT
    if _LIGHT is None:
        _LIGHT = start_light_stack(tmp_path_factory.mktemp("light-gateway"))
    for p in _LIGHT.procs.values():
        p.check_alive()
    return _LIGHT


def pytest_runtest_teardown(item, nextitem):
    global _LIGHT
    module = getattr(getattr(nextitem, "module", None), "__name__", "").rsplit(".", 1)[-1]
    if _LIGHT is not None and not module.startswith("test_gw_"):
        stop_light_stack(_LIGHT)
        _LIGHT = None
