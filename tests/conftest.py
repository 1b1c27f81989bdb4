"""Shared pytest setup: one seed per run, printed so a failure can be replayed."""
import os

import numpy as np
import pytest

SEED = int(os.environ.get("NVTE_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))


def pytest_report_header(config):
    return f"NVTE_TEST_SEED={SEED} (set it to replay this run's random inputs)"


@pytest.fixture
def rng(request):
    """A generator seeded from the run seed and the test's name (stable per test)."""
    import zlib

    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


def pytest_terminal_summary(terminalreporter):
    # Also at the end: `-q` runs (CI) do not print the report header.
    terminalreporter.write_line(f"random inputs used NVTE_TEST_SEED={SEED}")
