"""Inductor's CPU kernels built a few to a program (rewriter.devices.kernel_batches): the same
results forward and backward as eager, the kernels really batched (a backward compiled at the
first backward too), a program that fails to build falling back to Inductor's own builds, and
Inductor left alone outside the block."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor.utils import fresh_inductor_cache

from rewriter.devices.backends import get_backend
from rewriter.devices import kernel_batches
from rewriter.devices.executors import executors_for
from rewriter.devices.kernel_batches import program, split_includes, with_kernel_batches

pytestmark = pytest.mark.skipif(not kernel_batches.supported(), reason="this Inductor's private API differs")


def f(x, w):
    # several kernels: reductions on either side of a GEMM, forward and backward
    h = torch.softmax(x, dim=-1) * x.sum(-1, keepdim=True)
    y = torch.tanh(h @ w)
    return (y * y.mean(0)).sum()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(16, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True)


def _run(fn):
    x, w = _inputs()
    out = fn(x, w)
    out.backward()
    return out.detach(), x.grad, w.grad


@pytest.fixture
def groups(monkeypatch):
    """The kernel count of each program built, in order; "own": kernels Inductor built alone."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    seen: list = []
    made, own = kernel_batches._Group.__init__, CppPythonBindingsCodeCache.load_pybinding_async

    def spy(self, kernels, submit):
        seen.append(len(kernels))
        made(self, kernels, submit)

    def own_spy(*args, **kwargs):
        seen.append("own")
        return own(*args, **kwargs)
    monkeypatch.setattr(kernel_batches._Group, "__init__", spy)
    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_pybinding_async", own_spy)
    monkeypatch.setattr(kernel_batches, "GROUP", 2)
    # Inductor builds in a pool only with two compile threads or more (one core: in line, and
    # nothing is batched): two here, whatever the machine
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 2)
    return seen


def _compiled(backend):
    torch._dynamo.reset()
    return torch.compile(f, backend=backend)


def test_leading_includes_are_split_off_and_macros_refused():
    src = "#include <a.h>\n\n#include <b.h>\nextern \"C\" void kernel() {\n#pragma omp parallel\n{}\n}"
    head, body = split_includes(src)
    assert head == ["#include <a.h>", "#include <b.h>"] and body.startswith('extern "C" void kernel()')
    assert "#pragma omp parallel" in body
    assert split_includes("#include <a.h>\n#define N 4\nvoid kernel() {}") is None
    assert split_includes("void kernel() {}\n#include <late.h>") is None


def test_a_program_binds_each_kernel_under_its_own_name():
    text = program([(["const float*", "float*"], '#include <x.h>\nextern "C" void kernel(const float* a, float* b) {}'),
                    (["int64_t"], '#include <x.h>\nextern "C" void kernel(int64_t n) {}')])
    assert text.count("#include <x.h>") == 1
    assert "rewriter_batch_0::kernel_0(parse_arg<float*>(args, 0), parse_arg<float*>(args, 1))" in text
    assert "rewriter_batch_1::kernel_1(parse_arg<int64_t>(args, 0))" in text
    assert '{"kernel_1", kernel_1_py, METH_VARARGS, ""}' in text and "PyInit_kernel" in text


def test_batched_kernels_compute_what_eager_does_forward_and_backward(groups):
    want = _run(f)
    with fresh_inductor_cache():
        got = _run(_compiled(with_kernel_batches(torch._dynamo.lookup_backend("inductor"))))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # fp32, 32-long sums
    # every kernel, the backward's too (compiled at the first backward), in programs of up to two
    assert "own" not in groups and len(groups) >= 2 and max(groups) == 2 and sum(groups) > len(groups)


def test_a_program_that_fails_to_build_falls_back_to_inductors_own_builds(groups, monkeypatch, caplog):
    monkeypatch.setattr(kernel_batches, "program", lambda kernels: "this is not C++;\n")
    want = _run(f)
    with fresh_inductor_cache(), caplog.at_level(logging.WARNING, logger=kernel_batches.__name__):
        got = _run(_compiled(with_kernel_batches(torch._dynamo.lookup_backend("inductor"))))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert groups and groups[0] != "own" and "own" in groups and "each is built on its own" in caplog.text


def test_inductor_is_left_alone_outside_the_block(groups):
    kernel_batches._install()  # installed, but not in force
    want = _run(f)
    with fresh_inductor_cache():
        got = _run(_compiled("inductor"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert groups and set(groups) == {"own"}


def test_an_inductor_whose_api_differs_is_left_alone(groups, monkeypatch):
    monkeypatch.setattr(kernel_batches, "supported", lambda: False)
    want = _run(f)
    with fresh_inductor_cache():
        got = _run(_compiled(with_kernel_batches(torch._dynamo.lookup_backend("inductor"))))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert groups and set(groups) == {"own"}


def test_the_cpu_inductor_executor_batches_its_kernels():
    (ex,), _ = executors_for(get_backend("cpu"))
    assert ex.kernel_batches and ex.resolve().__name__ == "inductor"


def test_a_warm_cache_loads_the_programs_without_building_them(groups, monkeypatch):
    from torch._inductor import codecache
    from torch._inductor.cpp_builder import CppBuilder
    builds: list[str] = []
    build = CppBuilder.build

    def counted(self, *args, **kwargs):
        builds.append(self.get_target_file_path())
        return build(self, *args, **kwargs)
    monkeypatch.setattr(CppBuilder, "build", counted)
    backend = with_kernel_batches(torch._dynamo.lookup_backend("inductor"))
    want = _run(f)
    with fresh_inductor_cache():
        _run(_compiled(backend))
        cold, builds[:], programs = list(builds), [], len(groups)
        for cache in (codecache.PyCodeCache, codecache.CppPythonBindingsCodeCache):
            cache.cache_clear()  # this process's loaded modules forgotten: the cache folder remains
        got = _run(_compiled(backend))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # built cold; warm, the same programs loaded from the folder, none built
    assert cold and builds == [] and len(groups) == 2 * programs and "own" not in groups


def test_the_backward_is_compiled_with_the_forward_and_its_programs_are_not_waited_for(groups, monkeypatch):
    """The forward alone has run: the backward's programs are submitted already (compiled with
    the forward), and none of them has been waited for (each waits at its first call)."""
    waited: list = []
    function = kernel_batches._Group.function

    def spy(self, i):
        waited.append(id(self))
        return function(self, i)
    monkeypatch.setattr(kernel_batches._Group, "function", spy)
    made: list = []
    init = kernel_batches._Group.__init__

    def seen(self, kernels, submit):
        made.append(id(self))
        init(self, kernels, submit)
    monkeypatch.setattr(kernel_batches._Group, "__init__", seen)
    want = _run(f)
    with fresh_inductor_cache():
        fn = _compiled(with_kernel_batches(torch._dynamo.lookup_backend("inductor")))
        x, w = _inputs()
        out = fn(x, w)
        after_forward = (list(made), set(waited))
        out.backward()
    assert len(after_forward[0]) > len(after_forward[1]) >= 1  # programs built, not yet waited for
    assert set(made) == set(waited)  # the backward waited for the rest at its first calls
    for g, v in zip((out.detach(), x.grad, w.grad), want):
        torch.testing.assert_close(g, v, rtol=1e-5, atol=1e-5)


def test_a_deferred_kernel_puts_the_built_function_in_its_place():
    calls: list = []

    class Built:
        def result(self):
            calls.append("built")
            return lambda *a: sum(a)
    scope: dict = {}
    scope["k"] = kernel_batches._Deferred(Built(), scope, "k")
    assert scope["k"](1, 2) == 3 and calls == ["built"]
    assert scope["k"](3, 4) == 7 and calls == ["built"] and not isinstance(scope["k"], kernel_batches._Deferred)
