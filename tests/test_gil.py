"""Free-threaded Python: the loader says when an extension turned the GIL back on."""

from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings

import pytest
from subprocesses import run_python

import torch_spdl
from torch_spdl import gil

CPYTHON_TEXT = (
    "The global interpreter lock (GIL) has been enabled to load module 'fancy._C', which has "
    "not declared that it can run safely without the GIL. To override this behavior and keep "
    "the GIL disabled (at your own risk), run with PYTHON_GIL=0 or -Xgil=0."
)


@pytest.fixture
def interpreter(monkeypatch):
    """Pretend to be a build with or without the GIL, with it on or off; nothing warned yet."""
    monkeypatch.setattr(gil, "_warned", False)

    def pretend(free_threaded: bool, enabled: bool) -> None:
        monkeypatch.setattr(gil, "free_threaded_build", lambda: free_threaded)
        monkeypatch.setattr(gil, "gil_enabled", lambda: enabled)

    return pretend


def gil_warnings(loader) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(list(loader)) == 3
    return [str(w.message) for w in caught if "GIL" in str(w.message)]


def test_a_free_threaded_python_with_its_gil_back_warns_once_naming_the_module(
    interpreter, monkeypatch
):
    interpreter(free_threaded=True, enabled=True)
    importer = types.ModuleType("importer")
    importer.__warningregistry__ = {"version": 0, (CPYTHON_TEXT, RuntimeWarning, 1): True}
    monkeypatch.setitem(sys.modules, "importer", importer)
    loader = torch_spdl.DataLoader(range(6), batch_size=2, num_workers=2)
    first, second = gil_warnings(loader), gil_warnings(loader)
    assert len(first) == 1 and second == []
    assert "GIL was turned back on by importing 'fancy._C'" in first[0]
    assert "PYTHON_GIL=0" in first[0]


def test_without_a_named_module_the_warning_says_where_to_look(interpreter):
    interpreter(free_threaded=True, enabled=True)
    (message,) = gil_warnings(torch_spdl.DataLoader(range(6), batch_size=2, num_workers=2))
    assert "CPython named it in a RuntimeWarning" in message and "PYTHON_GIL=0" in message


@pytest.mark.parametrize(
    "free_threaded, enabled, workers", [(False, True, 2), (True, False, 2), (True, True, 0)]
)
def test_no_warning_where_the_gil_is_as_the_interpreter_was_built(
    interpreter, free_threaded, enabled, workers
):
    interpreter(free_threaded, enabled)
    assert gil_warnings(torch_spdl.DataLoader(range(6), batch_size=2, num_workers=workers)) == []


def test_the_interpreter_is_seen_as_it_is():
    """gil's answers against what the interpreter says of itself: its build configuration, its
    version string (which names a free-threading build) and, from 3.13, ``sys._is_gil_enabled()``;
    a build with the GIL has it on, always."""
    built_free = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    assert ("free-threading build" in sys.version) is built_free
    assert gil.free_threaded_build() is built_free
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    assert gil.gil_enabled() is (True if is_enabled is None else is_enabled())
    assert gil.gil_enabled() or built_free


KEEPS_THE_GIL_OFF = """
import sys
import torch_spdl
from torch_spdl import gil

batches = list(torch_spdl.DataLoader(range(8), batch_size=2, num_workers=2))
print(len(batches), sys._is_gil_enabled(), gil.gil_enabled())
"""


@pytest.mark.skipif(
    not sysconfig.get_config_var("Py_GIL_DISABLED"), reason="a build with the GIL: it stays on"
)
@pytest.mark.skipif("PYTHON_GIL" in os.environ, reason="PYTHON_GIL decides, not the imports")
def test_a_free_threaded_python_keeps_its_gil_off_through_torch_spdl():
    """On the CI's free-threaded leg: importing torch_spdl (torch, numpy, PIL with it) and running
    a loader with threads leave the GIL off, in a fresh interpreter as a script starts."""
    assert run_python("-c", KEEPS_THE_GIL_OFF).split() == ["4", "False", "False"]
