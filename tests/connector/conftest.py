"""The broker the connector's tests talk to: a real `kvbroker serve` process on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import BrokerProcess


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "1")
    b.start()
    yield b
    b.kill()
