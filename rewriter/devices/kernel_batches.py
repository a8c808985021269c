"""Inductor's CPU kernels built a few to a program, where Inductor builds each one alone.

Inductor (torch 2.13, CPU, its Python wrapper) makes every kernel of a graph a C++ program of
its own: ``AsyncCompile.cpp_pybinding(argtypes, source)``, one g++ run each, in its pool of
compile workers. Most of such a run does not depend on the kernel: g++ loads the precompiled
header (156 MB; ~0.38 s for an empty program) and links (~0.1 s), where a kernel's own code
takes ~0.15 s (2-core Xeon with AMX, g++ -O3). A cold BERT training compile (4 layers, nested
blocks, bf16 autocast) builds 25 kernels, two graphs' worth (forward 11, backward 14): ~12 s of
its ~18 s of g++ time is that fixed part, on two cores.

While :func:`batched_kernels` is in force (:func:`with_kernel_batches` wraps the backend call
and Inductor's inner compile in it), each kernel is queued instead; every ``GROUP`` kernels,
and whatever is queued when the graph's module waits for its kernels (``AsyncCompile.wait``),
become one program: each kernel's source in a namespace of its own, its entry ``kernel``
renamed ``kernel_<i>``, and a Python binding for each, written as Inductor writes its one. The
program is built by Inductor's own code cache (its flags, precompiled header, cache folder,
file locks and pool), so a warm cache loads it as it loads a kernel. The kernels and their
code are Inductor's; only how many go to one g++ run changes (the compiled step, interleaved in
one process, both ways: LLaMA 1.012x, BERT 1.015x, DistilBERT 1.017x, GPT-2 0.986x: the same).
Cold BERT's first compiled step, one process each, alternating: 28.0 / 28.1 s -> 21.6 / 21.3 s.
Nor does a graph's module wait for its programs: each kernel waits at its first call
(``_Deferred``), and the backward is compiled with the forward, so the builds overlap
Inductor's own work on the rest (:data:`DEFER`)::

    backend = with_kernel_batches(torch._dynamo.lookup_backend("inductor"))
    compiled = torch.compile(model, backend=backend)

A group that fails to build falls back to Inductor's own build of each of its kernels; a kernel
source this module does not recognise (preprocessor lines other than leading ``#include`` s and
``#pragma`` s), a single compile thread, or an Inductor whose private API differs from the
one described here, is left to Inductor.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Iterator

from rewriter.devices.inductor_scope import around_inductor, flag_on

log = logging.getLogger(__name__)

GROUP = 6  # kernels to a program: fewer g++ runs, still building while Inductor writes the rest
# A graph's module does not wait for its programs (each kernel waits at its first call), and
# the backward is compiled with the forward: the builds go on while Inductor lowers the
# backward and the next graphs, where Inductor waits for every kernel of a graph before it goes
# on (its main thread idle ~6.8 s of a cold LLaMA compile). Cold optimize(steps=20000), fp32,
# 4 layers, one process each, alternating, 2-core AMD EPYC: the regional compile LLaMA
# 12.9 / 13.0 / 12.8 s -> 11.7 / 11.1 / 10.3 s, BERT 11.4 s -> 10.5 / 9.6 / 9.4 s.
DEFER = True

_STATE = threading.local()
_INSTALLED: list[bool] = []  # the class patch, made once per process
_INSTALL_LOCK = threading.Lock()

# Inductor's binding protocol (CppPythonBindingsCodeCache, torch 2.13): a module named
# "kernel" whose function of the same name takes the arguments as a tuple; tensors are read
# through the address Inductor puts in this environment variable before it loads the module.
_ENTRY_CALL = "kernel({}); Py_RETURN_NONE;"
_DATA_PTR_VAR = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"

_PARSE_ARGS = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sstream>
#include <cstdlib>
#include <cerrno>

static void* (*_torchinductor_pyobject_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, size_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or long");
    return static_cast<T>(_torchinductor_pyobject_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if(result == -1 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, size_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if(result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, size_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if(result == -1.0 && PyErr_Occurred()) [[unlikely]]
        throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
"""

_BINDING = r"""
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if(!PyTuple_CheckExact(args)) [[unlikely]]
            throw std::runtime_error("tuple args required");
        if(PyTuple_GET_SIZE(args) != {n}) [[unlikely]]
            throw std::runtime_error("requires {n} args");
        rewriter_batch_{i}::kernel_{i}({args}); Py_RETURN_NONE;
    }} catch(std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch(...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled error");
        return nullptr;
    }}
}}
"""

_MODULE = r"""
static PyMethodDef py_methods[] = {{
{methods}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef py_module = {{PyModuleDef_HEAD_INIT, "kernel", NULL, -1, py_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* str_addr = std::getenv("{var}");
    if(!str_addr) {{
        PyErr_SetString(PyExc_RuntimeError, "{var} must be set");
        return nullptr;
    }}
    char* endptr = nullptr;
    errno = 0;
    uintptr_t addr = std::strtoull(str_addr, &endptr, 10);
    if(errno != 0 || endptr == str_addr || addr == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "Failed to parse {var}");
        return nullptr;
    }}
    _torchinductor_pyobject_tensor_data_ptr =
        reinterpret_cast<decltype(_torchinductor_pyobject_tensor_data_ptr)>(addr);
    PyObject* module = PyModule_Create(&py_module);
    if (module == NULL) {{
        return NULL;
    }}
    #ifdef Py_GIL_DISABLED
        PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
    #endif
    return module;
}}
"""


def split_includes(source: str) -> tuple[list[str], str] | None:
    """(the source's leading ``#include`` lines, the rest), or None when any other
    preprocessor line than a ``#pragma`` follows (a macro would leak into the next kernel)."""
    lines = source.strip("\n").split("\n")
    k = 0
    while k < len(lines) and (not lines[k].strip() or lines[k].lstrip().startswith("#include")):
        k += 1
    rest = lines[k:]
    if any(x.lstrip().startswith("#") and not x.lstrip().startswith("#pragma") for x in rest):
        return None
    return [x.strip() for x in lines[:k] if x.strip()], "\n".join(rest)


def program(kernels: list[tuple[list[str], str]]) -> str:
    """One C++ program holding ``kernels`` ((argtypes, source) as Inductor hands each one to
    ``cpp_pybinding``; every source accepted by :func:`split_includes`), kernel ``i`` bound as
    the module's function ``kernel_<i>``."""
    includes: list[str] = []
    bodies, bindings, methods = [], [], []
    for i, (argtypes, source) in enumerate(kernels):
        head, body = split_includes(source)  # type: ignore[misc]  (checked when queued)
        includes += [h for h in head if h not in includes]
        bodies.append(f"namespace rewriter_batch_{i} {{\n#define kernel kernel_{i}\n{body}\n"
                      f"#undef kernel\n}}  // namespace rewriter_batch_{i}")
        args = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes))
        bindings.append(_BINDING.format(i=i, n=len(argtypes), args=args))
        methods.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},')
    return "\n".join([*includes, *bodies, _PARSE_ARGS, *bindings,
                      _MODULE.format(methods="\n".join(methods), var=_DATA_PTR_VAR)])


class _Queue:
    """The kernels one wrapper module (one ``AsyncCompile``) has handed over and not built."""

    def __init__(self, submit: Callable[..., Any]) -> None:
        self.submit = submit
        self.pending: list[_Kernel] = []

    def add(self, argtypes: list[str], source: str) -> Any:
        from torch._inductor.codecache import LambdaFuture
        k = _Kernel(self, list(argtypes), source)
        self.pending.append(k)
        if len(self.pending) >= GROUP:
            self.flush()
        future = LambdaFuture(k.result)
        future.rewriter_kernel = k  # type: ignore[attr-defined]  (wait defers what it marks)
        return future

    def flush(self) -> None:
        if self.pending:
            _Group(self.pending, self.submit)
            self.pending = []


class _Group:
    """One program's kernels; its build is submitted at once."""

    def __init__(self, kernels: list[_Kernel], submit: Callable[..., Any]) -> None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache
        self.kernels, self.module, self.failed = kernels, None, False
        for i, k in enumerate(kernels):
            k.group, k.index = self, i
        try:
            self.load = CppPythonBindingsCodeCache.load_async(
                program([(k.argtypes, k.source) for k in kernels]), "cpu", submit_fn=submit)
        except Exception as e:
            self._fail(e)

    def function(self, i: int) -> Any:
        if self.module is None and not self.failed:
            try:
                self.module = self.load()
            except Exception as e:
                self._fail(e)
        return None if self.failed else getattr(self.module, f"kernel_{i}")

    def _fail(self, e: Exception) -> None:
        self.failed = True
        log.warning("rewriter: %d Inductor kernels built as one program failed (%s: %s); each is "
                    "built on its own", len(self.kernels), type(e).__name__, str(e)[:300])


class _Kernel:
    def __init__(self, queue: _Queue, argtypes: list[str], source: str) -> None:
        self.queue, self.argtypes, self.source = queue, argtypes, source
        self.group: _Group | None = None
        self.index = -1

    def result(self) -> Any:
        if self.group is None:  # asked for before its module waited: build what is queued
            self.queue.flush()
        fn = self.group.function(self.index)  # type: ignore[union-attr]
        if fn is None:  # the group's build failed: Inductor's own build of this kernel
            from torch._inductor.codecache import CppPythonBindingsCodeCache
            fn = CppPythonBindingsCodeCache.load_pybinding(self.argtypes, self.source)
        return fn


class _Deferred:
    """A batched kernel its module did not wait for: built while Inductor goes on; its first
    call waits for it and puts the built function in its place in the module."""

    __slots__ = ("kernel", "scope", "name")

    def __init__(self, kernel: _Kernel, scope: dict[str, Any], name: str) -> None:
        self.kernel, self.scope, self.name = kernel, scope, name

    def __call__(self, *args: Any) -> Any:
        fn = self.kernel.result()
        self.scope[self.name] = fn
        return fn(*args)


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """Whether this Inductor's private API is the one this module was written against."""
    try:
        from torch._inductor import async_compile, codecache
    except ImportError:
        return False
    c = getattr(codecache, "CppPythonBindingsCodeCache", None)
    AsyncCompile = getattr(async_compile, "AsyncCompile", None)
    if c is None or AsyncCompile is None or not hasattr(codecache, "LambdaFuture") \
            or not hasattr(async_compile, "get_compile_threads"):
        return False
    try:
        params = list(inspect.signature(AsyncCompile.cpp_pybinding).parameters)
        load_params = inspect.signature(c.load_async).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (params == ["self", "argtypes", "source_code"] and callable(getattr(AsyncCompile, "wait", None))
            and "submit_fn" in load_params and getattr(c, "entry_function", None) == "kernel"
            and getattr(c, "call_entry_function", None) == _ENTRY_CALL and not getattr(c, "extra_parse_arg", "")
            and _DATA_PTR_VAR in getattr(c, "suffix_template", ""))


def _install() -> None:
    """Route ``AsyncCompile.cpp_pybinding`` and ``wait`` through the queue while
    :func:`batched_kernels` is in force in this thread (Inductor's own behaviour otherwise)."""
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
        own_pybinding, own_wait = AsyncCompile.cpp_pybinding, AsyncCompile.wait

        def cpp_pybinding(self: Any, argtypes: list[str], source_code: str) -> Any:
            if not getattr(_STATE, "on", False) or get_compile_threads() <= 1 \
                    or split_includes(source_code) is None:
                return own_pybinding(self, argtypes, source_code)
            queue = self.__dict__.get("_rewriter_queue")
            if queue is None:
                queue = self.__dict__["_rewriter_queue"] = _Queue(self.submit)
            return queue.add(argtypes, source_code)

        def wait(self: Any, scope: dict[str, Any]) -> None:
            queue = self.__dict__.get("_rewriter_queue")
            if queue is not None:
                queue.flush()
                if DEFER:
                    for name, value in list(scope.items()):
                        k = getattr(value, "rewriter_kernel", None)
                        if isinstance(k, _Kernel):
                            scope[name] = _Deferred(k, scope, name)
            return own_wait(self, scope)

        cpp_pybinding.__wrapped__ = own_pybinding  # type: ignore[attr-defined]
        wait.__wrapped__ = own_wait  # type: ignore[attr-defined]
        AsyncCompile.cpp_pybinding, AsyncCompile.wait = cpp_pybinding, wait
        _INSTALLED.append(True)


@contextlib.contextmanager
def batched_kernels() -> Iterator[None]:
    """Inductor's CPU kernels built ``GROUP`` to a program within this block (this thread)."""
    if not supported():
        yield
        return
    _install()
    with flag_on(_STATE):
        yield


@contextlib.contextmanager
def _backward_with_forward() -> Iterator[None]:
    """AOTAutograd compiles the backward with the forward (not at the first backward), so its
    kernels build while the step runs forward and the next graphs compile (:data:`DEFER`)."""
    import torch._functorch.config as aot_config
    if not (DEFER and supported() and hasattr(aot_config, "force_non_lazy_backward_lowering")):
        yield
        return
    with aot_config.patch(force_non_lazy_backward_lowering=True):
        yield


def with_kernel_batches(inductor: Callable[..., Any]) -> Callable[..., Any]:
    """``inductor`` (``torch._inductor.compile_fx.compile_fx``, or Dynamo's "inductor" backend)
    with its CPU kernels batched: the call itself (a graph AOTAutograd's cache holds is loaded
    there) and its ``inner_compile``, which AOTAutograd also calls for a backward it compiles
    later, at the first backward."""
    return around_inductor(inductor, batched_kernels, _backward_with_forward)
