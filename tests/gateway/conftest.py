"""The light gateway stack (testbed/light_gateway.py): started by the first test that asks for it and
stopped after the last test of the test_gw_* modules (which run one after another), so it starts once."""

from __future__ import annotations

import pytest

from testbed.light_gateway import LightStack, start_light_stack, stop_light_stack
from tests.support.gateway_harness import Shared

_LIGHT = Shared(start_light_stack, stop_light_stack, "light-gateway")


@pytest.fixture
def light_stack(tmp_path_factory) -> LightStack:
    return _LIGHT.get(tmp_path_factory)


def pytest_runtest_teardown(item, nextitem):
    module = getattr(getattr(nextitem, "module", None), "__name__", "").rsplit(".", 1)[-1]
    if not module.startswith("test_gw_"):
        _LIGHT.release()
