"""Kernel tests: on a machine without CUDA, run the Triton kernels in the interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` kernel is defined, so it
is set here, when pytest loads this folder, ahead of the test modules' imports.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # triton.language's own @jit helpers (tl.zeros ...) were defined compiled, not interpreted: every
        # interpreted kernel would fail with "Cannot call @triton.jit'd outside of the scope of a kernel"
        raise pytest.UsageError("triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET: "
                                "a test module collected earlier imports it at module level; import it inside "
                                "the test instead")
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a 1-element array into a loop bound with int(array),
    which numpy >= 2.3 refuses; take the element instead (interpreter only)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if not getattr(original, "_hkv_fixed", False):
        patched._hkv_fixed = True
        interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
