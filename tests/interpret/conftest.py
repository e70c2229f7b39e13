"""The interpreter's language patches once a launch, not once a device-function call.

Triton's interpreter (3.9) patches ``triton.language`` (every builtin of ``tl``, ``tl.core``,
``tl.math`` and ``tl.tensor``, found by ``inspect.getmembers``) when a kernel launch starts, and
again at every call of a ``@triton.jit`` helper inside it, whose patches it never restores
(the launch's own restore, at its end, puts the originals back). The kernels call helpers tens
of thousands of times a test (``kdot``, the FMA chains), and those repeated patches were about
60 % of this folder's time while changing nothing: a builtin already patched is no longer a
builtin, so a second pass only sets the same wrappers again. Here a helper's call skips the
patch where the running launch has already patched the modules its globals see; a launch, and a
helper that sees another module, patch as before. The kernels run the same interpreted code.
"""

import inspect

import pytest

# Loaded only where tests/interpret/ is collected: TRITON_INTERPRET=1 (tests/conftest.py).
from triton import language as tl
from triton.runtime import interpreter


def _langs(fn) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


@pytest.fixture(autouse=True, scope="session")
def _patch_the_language_once_a_launch():
    original = interpreter._patch_lang
    active: set = set()  # the running launch's patched modules; empty between launches
    launch = []

    def patch_lang(fn):
        langs = _langs(fn)
        if launch and langs <= active:  # a helper inside a launch that patched these already
            return interpreter._LangPatchScope()
        scope = original(fn)
        if not launch:  # the launch's own patch (GridExecutor.__call__), restored at its end
            launch.append(scope)
            restore = scope.restore

            def restore_and_end():
                restore()
                active.clear()
                launch.clear()

            scope.restore = restore_and_end
        active.update(langs)
        return scope

    interpreter._patch_lang = patch_lang
    yield
    interpreter._patch_lang = original
