"""Checks that hold for every suite of the workspace."""

from __future__ import annotations

import os

import pytest

_UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find a pytest-xdist run that ignores the ``xdist_group`` marks.

    ``--dist loadgroup`` sends a group's tests to one worker by appending ``@group`` to
    their ids on the worker, after collection; when a pytest release moves the id where
    xdist does not write (pytest 9.2 with xdist 3.8), the marks are silently ignored: a
    module's expensive set-up runs once per worker, and the torchrun launches meant to run
    one at a time run side by side. Runs after xdist's own hook; every grouped test then
    errors with the reason (raising here would only show as a worker's INTERNALERROR)."""
    # (on a worker xdist sets "loadgroup"; the worker's "dist" option reads "no")
    if not os.environ.get("PYTEST_XDIST_WORKER") or \
            not config.getoption("loadgroup", default=False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[_UNGROUPED] = (
                f"pytest-xdist ignored this test's xdist_group mark, so --dist loadgroup "
                f"would spread its group over workers (pytest {pytest.__version__}; "
                f"pytest-dev/pytest-xdist#1386): install pytest<9.2")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _UNGROUPED in item.stash:
        pytest.fail(item.stash[_UNGROUPED], pytrace=False)
