"""Running Triton kernels on CPU through the interpreter (TRITON_INTERPRET=1), for tests.

Triton 3.6 decides interpreter-or-compiler when a kernel is *decorated*, i.e. when its module is
imported (and `tl.sum` & co. when Triton itself is imported), so call `interpret_without_cuda()`
before anything imports Triton.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import pytest
import torch


def interpret_without_cuda() -> None:
    """Without CUDA, make kernels decorated from now on run in the interpreter."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def kernel_test_setup(request: pytest.FixtureRequest) -> Iterator[None]:
    """Autouse in the kernel test modules that import it. A test not marked `gpu` hands CPU tensors
    to the kernels, which only works through the interpreter, and that is switched on only without
    CUDA: on a CUDA machine it skips (the `gpu`-marked tests cover the same kernels on the device).
    The fused switch is pinned on (it is the default), so a test that turns it off cannot leak."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        pytest.skip("Triton-interpreter test on CPU tensors; the gpu-marked tests cover CUDA")
    from tandem.kernels.fused import fused_ops  # imports no Triton

    with fused_ops(True):
        yield


def is_interpreted(fn: object) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def check_interpreted(kernel: object) -> None:
    """Fail with the fix when a kernel was decorated for the compiler on a machine without CUDA."""
    if not torch.cuda.is_available() and not is_interpreted(kernel):
        raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set; call "
                           "triton_interp.interpret_without_cuda() before anything imports triton")


@contextmanager
def numpy24_scalar_index() -> Iterator[None]:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into loop bounds
    with int(array), which numpy >= 2.4 refuses for non-0-d arrays; convert through the element
    while the context is open."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_scalar_index(tensor, scope):  # noqa: ANN001
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_scalar_index
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = patch_tensor


@contextmanager
def interpreted_language() -> Iterator[None]:
    """Without CUDA, run `tl.sum` & co. in the interpreter even when Triton was imported before
    TRITON_INTERPRET was set (e.g. by transformers): the standard library's @jit functions were then
    decorated for the compiler and refuse to be called; swap in interpreted twins while open."""
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    twins: dict[int, InterpretedFunction] = {}
    changes = []
    for mod in (tl, tl.core, tl.standard, tl.math):
        for name, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                twin = twins.setdefault(id(value), InterpretedFunction(value.fn))
                changes.append((mod, name, value))
                setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, value in reversed(changes):
            setattr(mod, name, value)


def interpreted_module(name: str, kernel: str, *, language: bool = False) -> Iterator[ModuleType]:
    """Body of a module-scoped fixture yielding the kernel module `name`. With CUDA: as imported.
    Without: if an earlier test module imported it (or, with `language`, Triton itself: `tl.zeros`,
    `tl.sum`, ...) before TRITON_INTERPRET was set, its definitions are re-executed so that they are
    decorated for the interpreter (module objects stay the same, so every reference sees the new
    functions; `kernel` names one to check), and numpy >= 2.4's scalar indexing is patched while open."""
    mod = importlib.import_module(name)
    if torch.cuda.is_available():
        yield mod
        return
    if language:
        import triton.language as tl

        if not is_interpreted(tl.standard.zeros):
            importlib.reload(tl.standard)
            importlib.reload(tl)
    if not is_interpreted(getattr(mod, kernel)):
        mod = importlib.reload(mod)
    with numpy24_scalar_index():
        yield mod


@contextmanager
def bf16_interpreted_dot() -> Iterator[None]:
    """Triton 3.6's interpreter multiplies bf16 `tl.dot` operands as their uint16 storage; while open,
    widen them to float32 first (exact, as the GPU's bf16 MMA with fp32 accumulation)."""
    if torch.cuda.is_available():
        yield
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot_bf16
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = create_dot
