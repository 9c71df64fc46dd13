"""What worker processes that do not fork can have of the main module.

A worker started by ``spawn`` or a fork server is a fresh interpreter: it recreates the main
module (as ``__mp_main__``) by importing it, by name where the program ran with ``python -m``,
else from its file, and unpickles what it is given against it. Three programs break that:

- a script without an ``if __name__ == "__main__":`` guard: every worker would run the training
  script again (:func:`unguarded_main`);
- a script read from standard input: its "file" (``<stdin>``) does not exist, so every worker
  fails as it starts;
- a notebook or ``python -c``: there is no file, so the workers' main module is empty, and a
  dataset class or a function defined there cannot be unpickled (:func:`unreachable_main`);
- a class or function the script defines only under its ``if __name__ == "__main__":`` guard:
  the workers' main module runs without the guard's body, so it lacks them.

torch's loader forks on Linux by default and meets none of these; ``"auto"`` therefore keeps such
a stage on threads and says why, and ``worker_method="process"`` names the problem at once
instead of failing every batch.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from typing import Any

from .pickled import contents


def _main_path(main: Any) -> str | None:
    """The main module's file, where it has one on disk (``python -m`` included)."""
    spec = getattr(main, "__spec__", None)
    path = getattr(spec, "origin", None) or getattr(main, "__file__", None)
    return path if path and os.path.isfile(path) else None


def _parse(path: str) -> ast.Module | None:
    """The script at ``path``, parsed once for each version of the file: worker processes are
    checked against it at every pass's start (8 ms for a script of 900 lines)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return _parse_version(path, found.st_mtime_ns, found.st_size)


@functools.lru_cache(maxsize=4)
def _parse_version(path: str, mtime_ns: int, size: int) -> ast.Module | None:
    try:
        with open(path, "rb") as file:
            return ast.parse(file.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def unguarded_main() -> str | None:
    """The main script's path where workers started by ``context`` would import it and it has no
    ``if __name__ == "__main__":`` guard at its top level: a worker would run the training script
    again (``spawn`` and fork servers import it, as ``__mp_main__``). None where it is safe: no
    main file (a notebook, ``python -c``) or a guard found. ``"auto"`` moves nothing to processes
    then; ``"process"``, asked for, documents the need, as torch does for ``spawn``."""
    path = _main_path(sys.modules.get("__main__"))
    if path is None:
        return None
    tree = _parse(path)
    if tree is None:
        return path
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            return None
    return path


def _is_main_test(test: ast.expr) -> bool:
    """A test that reads ``__name__`` against ``"__main__"``: ``__name__ == "__main__"`` either
    way round, and forms such as ``__name__ in ("__main__",)`` or ``... and args``, which a
    stricter reading would take for no guard and refuse worker processes for."""
    nodes = list(ast.walk(test))
    if any(isinstance(node, (ast.NotEq, ast.NotIn, ast.Not)) for node in nodes):
        return False  # the body runs in the workers, not in the script
    names = any(isinstance(node, ast.Name) and node.id == "__name__" for node in nodes)
    texts = any(isinstance(node, ast.Constant) and node.value == "__main__" for node in nodes)
    return names and texts


def _guarded_definitions(path: str) -> set[str]:
    """The classes and functions the script at ``path`` defines under its
    ``if __name__ == "__main__":`` guard and nowhere else at its top level."""
    tree = _parse(path)
    if tree is None:
        return set()
    guarded: set[str] = set()
    elsewhere: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            guarded |= _defined(node.body)
            elsewhere |= _defined(node.orelse)  # the else branch runs in the workers
        else:
            elsewhere |= _defined([node])
    return guarded - elsewhere


def _defined(statements: list[ast.stmt]) -> set[str]:
    """Names of the classes and functions ``statements`` define, in their nested blocks too
    (``if``, ``try``, ``with``, loops, ``match``), not inside those classes and functions."""
    names: set[str] = set()
    for node in statements:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            continue
        for block in _blocks(node):
            names |= _defined(block)
    return names


def _blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The blocks of statements nested in ``node``: bodies, ``else`` and ``finally`` branches,
    exception handlers and ``match`` cases."""
    fields = (getattr(node, name, None) for name in ("body", "orelse", "finalbody"))
    blocks = [field for field in fields if isinstance(field, list)]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    blocks += [case.body for case in getattr(node, "cases", [])]
    return blocks


def _main_names(job: Any, known: list[str] | None) -> list[str]:
    """``known``, or what pickling ``job`` finds of ``__main__``."""
    return contents(job).main_names if known is None else known


def unreachable_main(job: Any, main_names: list[str] | None = None) -> str | None:
    """Why workers that import the main module could not run ``job``, or None where they can:
    the main module was read from standard input (no worker can start), it has no file and
    ``job`` holds classes or functions defined in it, or ``job`` holds some the script defines
    only under its main guard (no worker can unpickle them). ``main_names``: the classes and
    functions of ``__main__`` that pickling ``job`` found, if the caller has them (else it is
    pickled here, where needed)."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    path = _main_path(main)
    if path is not None:
        guarded = _guarded_definitions(path)
        if not guarded:
            return None  # pickling the job cannot find what is not there
        names = [n for n in _main_names(job, main_names) if n.split(".")[0] in guarded]
        if not names:
            return None
        return (
            f"worker processes cannot unpickle {', '.join(names)}: defined under the main "
            'script\'s `if __name__ == "__main__":` guard, which they do not run (define it at '
            "the script's top level, or in a module)"
        )
    if getattr(getattr(main, "__spec__", None), "name", None):
        return None  # python -m: workers import it by name
    file = getattr(main, "__file__", None)
    if file is not None:
        return f"the main script was read from {file}, which worker processes cannot import"
    names = _main_names(job, main_names)
    if not names:
        return None
    return (
        f"worker processes cannot unpickle {', '.join(names)}: defined in __main__, which has "
        "no file they could import (a notebook or python -c)"
    )
