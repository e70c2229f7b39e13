"""``ssm_spec.graphs`` from a source checkout that is not installed.

The capture package lives in the repository's top-level ``graphs/`` folder and installs as
``ssm_spec.graphs`` (``pyproject.toml``'s ``package-dir``; an editable install maps it the same
way). Code run straight from a checkout (``PYTHONPATH=<repo>``, as the GPU machine runs it) has
no such mapping, so this finder supplies it: it answers for ``ssm_spec.graphs`` only, only when
the folder sits beside ``ssm_spec/``, and only after every other finder (an installed package
wins). Submodules resolve through the package's ``__path__`` as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_GRAPHS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphs")


class _GraphsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "ssm_spec.graphs":
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(_GRAPHS, "__init__.py"),
                                                      submodule_search_locations=[_GRAPHS])


def install() -> None:
    """Append the finder once, if the checkout's ``graphs/`` folder exists."""
    if os.path.isfile(os.path.join(_GRAPHS, "__init__.py")) and not any(
            isinstance(f, _GraphsFinder) for f in sys.meta_path):
        sys.meta_path.append(_GraphsFinder())
