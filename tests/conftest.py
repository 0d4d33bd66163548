import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package is not installed into the venv; tests import it from the checkout.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from redis_server import RedisServer  # noqa: E402


@pytest.fixture
def redis_server():
    """A fresh real redis-server per test (RedisServer: .url, .client(), .stop(), .restart(), .kill())."""
    with RedisServer() as srv:
        yield srv
