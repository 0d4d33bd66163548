"""use_cpu_linears bounds oneDNN's and ideep's primitive caches (worker/engine/backends/cpu_linear.py:
ONEDNN_CACHE_ENTRIES) before it makes the first primitive, and keeps a value the user set."""

from __future__ import annotations

import os

import pytest
from torch import nn

from worker.engine.backends.cpu_linear import ONEDNN_CACHE_ENTRIES, onednn_prepack_available, use_cpu_linears

pytestmark = pytest.mark.skipif(not onednn_prepack_available(), reason="this torch has no oneDNN prepacked linear")


def test_cache_bounds_set_unless_the_user_set_them(monkeypatch):
    names = sorted(ONEDNN_CACHE_ENTRIES)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(names[0], "7")
    assert use_cpu_linears(nn.Sequential(nn.Linear(8, 8)), ext=None) == 1
    assert os.environ[names[0]] == "7", "the user's value was overwritten"
    assert all(os.environ[n] == ONEDNN_CACHE_ENTRIES[n] for n in names[1:])
