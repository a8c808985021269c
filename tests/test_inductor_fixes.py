"""Inductor's CPU miscompiles fixed for rewriter's compiles (rewriter.devices.inductor_fixes):
torch 2.13's 2D-tiled scatter-add adds the tile's inner offset twice. The probe keeps every
index, right or doubled, inside its table, so the unfixed kernel computes wrong values without
writing past the buffer (T5's bias table had no such room: the process crashed)."""
from __future__ import annotations

import pytest
import torch
import torch._functorch.config as aot_config
from torch._inductor.utils import fresh_inductor_cache

from rewriter.devices import inductor_fixes
from rewriter.devices.backends import get_backend
from rewriter.devices.executors import executors_for
from rewriter.devices.inductor_fixes import TAG, fixed_codegen, with_inductor_fixes

pytestmark = pytest.mark.skipif(not inductor_fixes.supported(), reason="this Inductor's code generation differs")


def scatter(idx, a, b):
    # read along both loops of [4, N] (b) and [N, 4] (a): a 2D-tiled kernel; the scatter-add's
    # index (column + 4 * row) holds the tiled outer loop variable itself
    g = a + (b[0] + b[1] + b[2]).t()
    return torch.zeros(64, 4).index_put((idx,), g, accumulate=True)


def _probe():
    torch.manual_seed(0)
    n = 1024
    # rows 0..15 of 64: the doubled offset (at most +3) stays inside the table
    return torch.randint(0, 16, (n,)), torch.randn(n, 4), torch.randn(3, 4, n)


@pytest.fixture
def two_threads():
    # the miscompiled store is the multi-threaded one (with one thread Inductor stores another way)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(before)


def _compiled_scatter(backend):
    with fresh_inductor_cache():
        return torch.compile(scatter, backend=backend, fullgraph=True)(*_probe())


@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="the miscompile was seen on torch 2.13")
def test_plain_inductor_scatters_to_the_wrong_rows_on_this_torch(two_threads):
    tag = torch.compiler.config.cache_key_tag
    with fixed_codegen():
        pass  # the fix installed, but not in force: Inductor's own code generation
    got, want = _compiled_scatter("inductor"), scatter(*_probe())
    assert (got - want).abs().max() > 1.0  # rows of 4 shifted, not rounding
    assert torch.compiler.config.cache_key_tag == tag


def test_the_cpu_executor_compiles_the_scatter_as_eager_computes_it(two_threads):
    (ex,), _ = executors_for(get_backend("cpu"))
    assert ex.codegen_fixes
    got, want = _compiled_scatter(ex.resolve()), scatter(*_probe())
    # fp32 sums of up to ~N/16 * 4 terms each, in another order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_backward_compiled_at_the_first_backward_is_fixed_too(two_threads, monkeypatch):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    seen = []

    def inner(*args, **kwargs):
        seen.append((getattr(inductor_fixes._STATE, "on", False), torch.compiler.config.cache_key_tag))
        return compile_fx_inner(*args, **kwargs)

    def f(x, w):
        return torch.tanh(x @ w).sum()

    tag = torch.compiler.config.cache_key_tag
    fixed = with_inductor_fixes(compile_fx)
    backend = lambda gm, ins: fixed(gm, ins, inner_compile=inner)  # noqa: E731
    x, w = torch.randn(8, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    with fresh_inductor_cache(), aot_config.patch(force_non_lazy_backward_lowering=False):
        out = torch.compile(f, backend=backend)(x, w)
        assert len(seen) == 1  # the forward; the backward waits for the first backward
        out.backward()
    ours = f"{tag}+{TAG}" if tag else TAG
    assert seen == [(True, ours), (True, ours)]
    torch.testing.assert_close(w.grad, x.detach().t() @ (1 - torch.tanh(x.detach() @ w.detach()) ** 2))
    # outside the compiles: Inductor's own, the user's cache tag as it was
    assert not getattr(inductor_fixes._STATE, "on", False) and torch.compiler.config.cache_key_tag == tag


def test_the_users_cache_tag_is_kept_beside_ours(monkeypatch):
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "mine")
    with fixed_codegen():
        assert torch.compiler.config.cache_key_tag == f"mine+{TAG}"
        with fixed_codegen():  # nested: tagged once
            assert torch.compiler.config.cache_key_tag == f"mine+{TAG}"
    assert torch.compiler.config.cache_key_tag == "mine"


@pytest.mark.parametrize("version", ["2.6.0", "2.14.0", "3.0.0a0+git"])
def test_an_inductor_before_the_path_or_after_the_upstream_fix_is_left_alone(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "")
    assert not inductor_fixes.supported()
    with fixed_codegen():
        assert torch.compiler.config.cache_key_tag == ""
