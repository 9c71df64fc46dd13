"""Whether the GIL binds this process: free-threaded Python, and an extension that undoes it.

On a free-threaded interpreter (CPython 3.13t/3.14t, built with ``--disable-gil``) worker threads
run Python in parallel, so threads are the right executor for every stage. But importing an
extension module that does not declare free-threading support turns the GIL back on for the
whole process, with only a RuntimeWarning at import time (triton did it, imported by
torchvision through torch._dynamo). A user who chose a free-threaded Python for their loader then
gets a GIL-bound one without a word: :func:`check` warns once, naming the fix.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import warnings

_CPYTHON_WARNING = re.compile(r"GIL\) has been enabled to load module '([^']+)'")
_warned = False


def free_threaded_build() -> bool:
    """Whether this interpreter was built without the GIL (``python3.13t`` and later)."""
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def gil_enabled() -> bool:
    """Whether the GIL is on now: always on a standard build; on a free-threaded one, unless an
    extension module (or ``PYTHON_GIL=1``) turned it back on."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else is_enabled()


def modules_that_enabled_the_gil() -> list[str]:
    """The modules CPython named when it turned the GIL on, where its RuntimeWarning was recorded
    in a module's ``__warningregistry__`` (Python's default action for RuntimeWarning)."""
    names = set()
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if not isinstance(registry, dict):
            continue
        for key in list(registry):
            if isinstance(key, tuple) and key and isinstance(key[0], str):
                match = _CPYTHON_WARNING.search(key[0])
                if match:
                    names.add(match.group(1))
    return sorted(names)


def check() -> None:
    """Warn once per process when a free-threaded interpreter runs with the GIL on."""
    global _warned
    if _warned or not free_threaded_build() or not gil_enabled():
        return
    _warned = True
    culprits = modules_that_enabled_the_gil()
    named = (
        f"by importing {', '.join(repr(name) for name in culprits)}, which "
        "does not declare free-threading support"
        if culprits
        else "by an extension module that does not declare free-threading support (CPython "
        "named it in a RuntimeWarning when it was imported), or by PYTHON_GIL=1"
    )
    warnings.warn(
        "This is a free-threaded Python, but the GIL was turned back on "
        f"{named}: torch_spdl's worker threads now take turns to run Python. Run with "
        "PYTHON_GIL=0 (or python -X gil=0) to keep it off if that module is safe without it, "
        "or avoid importing it (triton, for one, is imported by torchvision and is only needed "
        "by torch.compile).",
        RuntimeWarning,
        stacklevel=3,
    )
