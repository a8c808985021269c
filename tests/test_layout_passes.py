"""Layout and dtype passes (issue 4): narrow_int64, make_contiguous, pad_to_alignment,
to_channels_last. Each fires, keeps outputs and gradients, declines where it must, and is kept or
rejected by the gate as a controlled clock says."""
import csv
import glob
import operator
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rewriter
from passes import narrow_int64
from rewriter.capture.ir import op_name
from rewriter.devices.backends import CpuBackend, CudaBackend, NpuBackend
from rewriter.pass_api import PassContext, registered_passes
from tests.controlled import QUICK, ControlledClock
from tests.helpers import code, outputs_and_grads, rewrite

# --- small models, one pattern each --------------------------------------------------------------

class Positions(nn.Module):
    """Position ids from arange, used by an embedding, a comparison and a gather."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)

    def forward(self, x):
        pos = torch.arange(x.size(1)) + 2
        causal = pos[None, :] <= pos[:, None]
        picked = torch.gather(x, 1, pos.expand(x.size(0), -1) - 2)
        return self.emb(pos), causal, picked, pos


class IntChain(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(4000, 4)

    def forward(self, ids):
        if self.form == "input":           # token ids: values unknown
            return ids * 2 + 1
        if self.form == "too_big":         # up to 999 * 10**7: does not fit int32
            return torch.arange(1000) * 10**7
        if self.form == "no_arithmetic":   # nothing runs int64 arithmetic
            return self.emb(torch.arange(ids.size(1)))
        if self.form == "in_place":
            pos = torch.arange(ids.size(1)) + 1
            pos.add_(ids.size(0))
            return pos
        if self.form == "scaled":          # fits for sizes <= MAX_SIZE only
            return torch.arange(ids.size(0)) * 2000
        raise ValueError(self.form)


class SharedTranspose(nn.Module):
    """A transposed activation read by two GEMMs, an element-wise op, and a permute into reshape."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(16, 4))

    def forward(self, x):
        v = x.transpose(1, 2)
        return v @ self.w1, v @ self.w2, v * 2, x.permute(0, 2, 1).reshape(x.size(0), -1)


class StridedReaders(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        if self.form == "contiguous":      # no view at all
            return x @ self.w, torch.matmul(x, self.w)
        if self.form == "one_norm":        # one reader, which copies anyway
            return F.layer_norm(x.transpose(1, 2), (x.size(1),))
        if self.form == "elementwise":     # readers that take strides as they are
            v = x.transpose(1, 2)
            return v * 2, v + 1
        if self.form == "model_contiguous":
            return x.transpose(1, 2).contiguous() @ self.w
        if self.form == "written":         # a write into x between the view and its reader
            v = x.transpose(1, 2)
            x.mul_(2)
            return v @ self.w
        raise ValueError(self.form)


class Mlp(nn.Module):
    def __init__(self, d_in=100, d_out=200, bias=True):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, x):
        return F.relu(self.fc(x))


class Bmm(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b).relu()


class ConvNet(nn.Module):
    def __init__(self, shared=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = self.c1 if shared else nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8, 2)
        self.shared = shared

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = self.c2(h if not self.shared else h[:, :3])
        return self.fc(h.mean((2, 3))), h


# --- helpers -----------------------------------------------------------------------------------

def _same(model, cap, args, rtol=1e-5, atol=1e-5):
    """Outputs and gradients (inputs and parameters) of the rewrite match the original."""
    params = list(model.parameters())
    want = outputs_and_grads(model, args, params)
    got = outputs_and_grads(cap, args, params)
    assert len(got[0]) == len(want[0]) and len(got[1]) == len(want[1])
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def _exact_with_ints(model, cap, args):
    """Integer and bool outputs equal in value and dtype; float outputs and the gradients
    reaching parameters and float inputs bit-identical (the float ops are the same ops)."""
    results = []
    for fn in (model, cap):
        for p in model.parameters():
            p.grad = None
        inputs = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
        outs = fn(*inputs)
        gen = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.is_floating_point())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()] + [a.grad for a in inputs if a.grad is not None]
        results.append(([o.detach() for o in outs], grads))
    (want, want_grads), (got, got_grads) = results
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _optimize(model, args, pass_name, cost, **kw):
    return rewriter.optimize(model, args, passes=[pass_name], clock=ControlledClock({pass_name: cost}),
                             gate=QUICK, progress=False, profile=False, **kw)


def _kernel_rows(shim, fn, args, directory):
    """kernel_details.csv rows of one run of ``fn`` under the shim's torch_npu profiler."""
    with shim.profiler.profile(record_shapes=True,
                               on_trace_ready=shim.profiler.tensorboard_trace_handler(directory)):
        fn(*args)
    path, = glob.glob(os.path.join(directory, "*_ascend_pt", "ASCEND_PROFILER_OUTPUT", "kernel_details.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


# --- narrow_int64 --------------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_narrow_int64_fires_and_is_exact(front_end):
    model, x = Positions(), torch.randn(3, 7)
    cap, sites = rewrite(model, (x,), "narrow_int64", front_end=front_end, training=True)
    src = code(cap)
    assert len(sites) == 1
    # fx reads x.size(1) in the graph (checked at run time); Dynamo baked it in as 7.
    assert ("int32_if_sizes_fit(size)" if front_end == "fx" else "arange(7, dtype = torch.int32)") in src
    # gather needs int64 indices and the returned tensor keeps its dtype: two casts back; the
    # embedding and the comparison read the int32 values as they are.
    assert src.count(".to(torch.int64)") == 2
    nodes = list(cap.slots[0].kept.graph.nodes)
    assert next(n for n in nodes if n.target is F.embedding).args[0].target is operator.add
    assert next(n for n in nodes if n.target is torch.gather).args[2].target == "to"
    _exact_with_ints(model, cap, (x,))


def test_narrow_int64_size_reads_are_checked_at_run_time():
    model = IntChain("scaled")
    cap, sites = rewrite(model, (torch.zeros(5, dtype=torch.long),), "narrow_int64")
    assert len(sites) == 1 and "int32_if_sizes_fit(size)" in code(cap)
    assert narrow_int64.int32_if_sizes_fit(5, narrow_int64.MAX_SIZE) is torch.int32
    assert narrow_int64.int32_if_sizes_fit(narrow_int64.MAX_SIZE + 1) is torch.int64
    # The proof assumed size <= MAX_SIZE; beyond it int32 would overflow (> 2**31 - 1), and the
    # graph falls back to int64.
    big = torch.zeros(narrow_int64.MAX_SIZE + 2**17, dtype=torch.long)
    got, want = cap(big), model(big)
    assert int(want.max()) > 2**31 - 1 and got.dtype == torch.int64
    assert torch.equal(got, want)


class PositionsThroughViews(nn.Module):
    """LLaMA's position ids: arange + offset, a view, a comparison, then a float use."""

    def forward(self, x):
        pos = torch.arange(x.size(1)) + 0
        row = pos[None, :]
        keep = row <= pos[:, None]
        return x * row.float() + keep.float().sum(-1)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_narrow_int64_chain_is_one_local_region_with_its_views(front_end):
    # The chain's nodes keep their names and calls but change dtype: the site covers them, so
    # its region runs from the arange to the cast back, and the gate measures it on its own
    # instead of on the whole step.
    model, x = PositionsThroughViews(), torch.randn(3, 6)
    fast = rewriter.optimize(model, (x,), passes=["narrow_int64"], progress=False, profile=False,
                             gate=QUICK, clock=ControlledClock({"narrow_int64": 0.5}), compile=False)
    d, = fast.report.decisions
    assert d.scope == "site" and "whole step" not in d.reason, d.reason
    assert d.regions and d.regions[0]["boundary"] is not None
    torch.testing.assert_close(fast(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("form", ["input", "too_big", "no_arithmetic", "in_place"])
def test_narrow_int64_declines(form):
    model, ids = IntChain(form), torch.randint(0, 9, (2, 6))
    cap, sites = rewrite(model, (ids,), "narrow_int64")
    assert sites == [] and "int32" not in code(cap)
    if form == "in_place":
        gm = cap.slots[0].kept
        assert any("in place" in reason for reason in narrow_int64.chains(gm)[1])


def test_narrow_int64_moves_arithmetic_off_the_ai_cpu_on_npu_shim(fake_torch_npu, tmp_path):
    """On the shim's profile (int64 operands of a non-indexing op run on the AI CPU, as the
    advisor's rules say), the rewrite leaves no arithmetic or comparison on the AI CPU."""
    model, x = Positions(), torch.randn(3, 7)
    cap, sites = rewrite(model, (x,), "narrow_int64", backend=NpuBackend())
    assert len(sites) == 1
    with torch.no_grad():
        before = _kernel_rows(fake_torch_npu, model, (x,), str(tmp_path / "before"))
        after = _kernel_rows(fake_torch_npu, cap, (x,), str(tmp_path / "after"))
    ai_cpu = lambda rows: {r["Type"] for r in rows if r["Accelerator Core"] == "AI_CPU"}  # noqa: E731
    assert {"add", "le", "sub"} <= ai_cpu(before)
    # What stays are the casts back to int64 (the shim's rule counts any int64 operand; Cast
    # int32 <-> int64 is on the AI Core's dtype list, reference §6).
    assert ai_cpu(after) <= {"to", "_to_copy", "copy_"}


@pytest.mark.parametrize("cost", [0.5, 2.0])
def test_narrow_int64_gate_decides(cost):
    model, x = Positions().eval(), torch.randn(3, 7)
    fast = _optimize(model, (x,), "narrow_int64", cost)
    assert fast.report.kept_passes == (["narrow_int64"] if cost < 1 else [])
    with torch.no_grad():
        for g, w in zip(fast(x), model(x)):
            assert g.dtype == w.dtype and torch.equal(g, w)


# --- make_contiguous -----------------------------------------------------------------------------

@pytest.mark.parametrize("front_end,backend", [("fx", CpuBackend()), ("dynamo", CpuBackend()),
                                               ("fx", NpuBackend())])
def test_make_contiguous_fires_and_keeps_numerics(front_end, backend):
    model, x = SharedTranspose(), torch.randn(2, 16, 5)
    cap, sites = rewrite(model, (x,), "make_contiguous", front_end=front_end, training=True, backend=backend)
    src = code(cap)
    assert len(sites) == 2 and src.count(".contiguous()") == 2
    nodes = list(cap.slots[0].kept.graph.nodes)
    assert [n.args[0].target for n in nodes if op_name(n) in ("matmul", "reshape")] == ["contiguous"] * 3
    assert next(n for n in nodes if op_name(n) == "mul").args[0].target == "transpose"  # keeps the view
    assert "npu_format_cast" not in src  # declined on purpose: see the pass's docstring
    _same(model, cap, (x,))


@pytest.mark.parametrize("form", ["contiguous", "one_norm", "elementwise", "model_contiguous", "written"])
def test_make_contiguous_declines(form):
    model, x = StridedReaders(form), torch.randn(2, 16, 16)
    cap, sites = rewrite(model, (x,), "make_contiguous")
    assert sites == []


@pytest.mark.parametrize("cost", [0.5, 2.0])
def test_make_contiguous_gate_decides(cost):
    model, x = SharedTranspose().eval(), torch.randn(2, 16, 5)
    fast = _optimize(model, (x,), "make_contiguous", cost)
    assert fast.report.kept_passes == (["make_contiguous"] if cost < 1 else [])
    with torch.no_grad():
        for g, w in zip(fast(x), model(x)):
            torch.testing.assert_close(g, w)


# --- pad_to_alignment ----------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("bias", [True, False])
def test_pad_linear_fires_keeps_numerics_and_parameters(front_end, bias):
    model, x = Mlp(bias=bias), torch.randn(4, 9, 100)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    cap, sites = rewrite(model, (x,), "pad_to_alignment", front_end=front_end, training=True)
    assert len(sites) == 1 and "K 100->112, N 200->208" in sites[0].description
    src = code(cap)
    assert "pad(" in src and "torch.narrow(" in src and ", 200)" in src
    _same(model, cap, (x,))  # one GEMM either way; a longer K may block the sum differently
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    with torch.no_grad():  # a weight changed after the rewrite is used: padding is in the graph
        model.fc.weight.mul_(2)
        torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)


def test_pad_linear_in_bfloat16():
    model, x = Mlp().to(torch.bfloat16), torch.randn(4, 100, dtype=torch.bfloat16)
    cap, sites = rewrite(model, (x,), "pad_to_alignment")
    assert len(sites) == 1
    torch.testing.assert_close(cap(x), model(x))  # bf16 tolerance: GEMM blocking may differ


def test_pad_bmm_reads_activation_sizes_in_the_graph():
    model = Bmm()
    a, b = torch.randn(2, 5, 100), torch.randn(2, 100, 60)
    cap, sites = rewrite(model, (a, b), "pad_to_alignment", training=True)
    assert len(sites) == 1 and "K 100->112, N 60->64" in sites[0].description
    src = code(cap)
    assert "torch.bmm(" in src and ".size(-1)" in src and "% 16" in src
    _same(model, cap, (a, b))
    # An fx graph serves every input shape: other K and N are padded by what they need.
    a2, b2 = torch.randn(3, 4, 40), torch.randn(3, 40, 24)
    _same(model, cap, (a2, b2))


@pytest.mark.parametrize("model,args,why", [
    (Mlp(64, 128), (torch.randn(4, 64),), "already multiples"),
    (Mlp(10, 6), (torch.randn(4, 10),), "grow it by more than"),
    (Bmm(), (torch.randint(0, 5, (2, 4, 100), dtype=torch.int32),
             torch.randint(0, 5, (2, 100, 60), dtype=torch.int32)), "not floating point"),
])
def test_pad_declines(model, args, why):
    from passes.pad_to_alignment import alignment_for, can_pad
    cap, sites = rewrite(model, args, "pad_to_alignment")
    assert sites == []
    gm = cap.slots[0].kept
    gemm = next(n for n in gm.graph.nodes if n.target in (F.linear, torch.bmm))
    assert why in can_pad(gemm, alignment_for(PassContext(CpuBackend(), False)), None)[1]


def test_pad_declines_matrix_vector_product():
    class MatVec(nn.Module):
        def forward(self, m, v):
            return torch.matmul(m, v)
    assert rewrite(MatVec(), (torch.randn(30, 100), torch.randn(100)), "pad_to_alignment")[1] == []


def test_pad_alignment_follows_the_device():
    """NPU: multiples of 16, of 128 when that costs at most 1/8 more; CUDA: multiples of 8."""
    wide, x = Mlp(1000, 1000), torch.randn(2, 1000)
    cap, sites = rewrite(wide, (x,), "pad_to_alignment", backend=NpuBackend())
    assert "K 1000->1024, N 1000->1024" in sites[0].description
    with torch.no_grad():
        torch.testing.assert_close(cap(x), wide(x), rtol=1e-5, atol=1e-5)
    narrow_model = Mlp(100, 200)
    sites = rewrite(narrow_model, (torch.randn(2, 100),), "pad_to_alignment", backend=NpuBackend())[1]
    assert "K 100->112, N 200->208" in sites[0].description  # 128 would add 28%: 16 it is
    assert rewrite(wide, (x,), "pad_to_alignment", backend=CudaBackend())[1] == []  # 1000 = 125 * 8


@pytest.mark.parametrize("cost", [0.5, 2.0])
def test_pad_gate_decides(cost):
    model, x = Mlp().eval(), torch.randn(4, 100)
    fast = _optimize(model, (x,), "pad_to_alignment", cost)
    assert fast.report.kept_passes == (["pad_to_alignment"] if cost < 1 else [])
    assert ("narrow" in fast.graph_code()["graph_0"]) == (cost < 1)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)


# --- to_channels_last ----------------------------------------------------------------------------

@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_channels_last_fires_and_keeps_numerics(front_end):
    model, x = ConvNet(), torch.randn(2, 3, 10, 10)
    cap, sites = rewrite(model, (x,), "to_channels_last", front_end=front_end, training=True)
    src = code(cap)
    # one conversion per tensor: the image, two weights, and the second conv's input
    assert len(sites) == 2 and src.count("memory_format = torch.channels_last") == 4
    _same(model, cap, (x,), rtol=1e-4, atol=1e-5)  # NHWC kernels sum in another order
    assert cap(x)[1].is_contiguous()  # a 4-D output comes back in the layout it had


def test_channels_last_converts_a_shared_weight_once():
    model, x = ConvNet(shared=True), torch.randn(2, 3, 10, 10)
    cap, sites = rewrite(model, (x,), "to_channels_last")
    assert len(sites) == 2 and code(cap).count("c1_weight.contiguous(memory_format") == 1
    with torch.no_grad():
        torch.testing.assert_close(cap(x), model(x), rtol=1e-4, atol=1e-5)


def test_channels_last_declines():
    x = torch.randn(2, 3, 10, 10)
    # already channels_last
    assert rewrite(ConvNet(), (x.contiguous(memory_format=torch.channels_last),), "to_channels_last")[1] == []
    # conv1d, and an unbatched conv2d input
    conv1d = nn.Sequential(nn.Conv1d(3, 4, 3))
    assert rewrite(conv1d, (torch.randn(2, 3, 9),), "to_channels_last")[1] == []
    unbatched = nn.Sequential(nn.Conv2d(3, 4, 3))
    assert rewrite(unbatched, (torch.randn(3, 9, 9),), "to_channels_last")[1] == []
    # not an NPU pass: the NPU keeps its own convolution formats
    why = registered_passes()["to_channels_last"].applies_to(PassContext(NpuBackend(), False))
    assert why is not None and "npu" in why


@pytest.mark.parametrize("cost", [0.5, 2.0])
def test_channels_last_gate_decides(cost):
    model, x = ConvNet().eval(), torch.randn(2, 3, 10, 10)
    fast = _optimize(model, (x,), "to_channels_last", cost)
    assert fast.report.kept_passes == (["to_channels_last"] if cost < 1 else [])
    with torch.no_grad():
        for g, w in zip(fast(x), model(x)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_registered_in_order_before_cast_to_half():
    names = list(registered_passes())
    order = ["fold_batch_norm", "narrow_int64", "make_contiguous", "pad_to_alignment", "to_channels_last",
             "cast_to_half"]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    assert names[0] == "fuse_qkv_projections" and names[-1] == "cast_to_half"
    assert all(registered_passes()[n].contract == "exact" for n in order[1:-1])


# --- review regressions: inputs the passes must keep exact (or decline) -------------------------

def _same_no_grad(model, cap, args):
    """Outputs (any dtype, layout-independent) and the inputs after the call (a model may write
    into them) equal; inputs are cloned per run, the calls under no_grad (what ``rewrite`` compiled
    Dynamo graphs under)."""
    a1, a2 = [a.clone() for a in args], [a.clone() for a in args]
    with torch.no_grad():
        want, got = model(*a1), cap(*a2)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(list(got) + a2, list(want) + a1):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    return got


class CompareBeyondInt32(nn.Module):
    """Comparisons of narrowed positions with values int32 cannot hold."""

    def __init__(self):
        super().__init__()
        self.register_buffer("limit", torch.tensor(2**32))

    def forward(self, x):
        pos = torch.arange(x.size(1)) + 1
        return pos < 2**32, pos != -2**33, pos < self.limit, pos[None, :] <= pos[:, None]


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_narrow_int64_comparison_with_a_value_beyond_int32(front_end):
    # an int32 tensor compared with a Python int or a 0-d int64 tensor computes in int32: the
    # value wraps (2**32 -> 0) and every comparison came out False.
    model, x = CompareBeyondInt32(), torch.randn(2, 7)
    cap, sites = rewrite(model, (x,), "narrow_int64", front_end=front_end)
    assert len(sites) == 1  # the pos <= pos comparison still runs in int32
    got = _same_no_grad(model, cap, (x,))
    assert bool(got[0].all()) and bool(got[2].all())


class EmbeddingByKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(20, 3))

    def forward(self, x):
        pos = torch.arange(x.size(1)) + 1
        return F.embedding(input=pos, weight=self.w), pos < 3


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_narrow_int64_embedding_indices_by_keyword(front_end):
    model, x = EmbeddingByKeyword(), torch.randn(2, 7)
    cap, sites = rewrite(model, (x,), "narrow_int64", front_end=front_end)  # raised IndexError
    assert len(sites) == 1
    _same_no_grad(model, cap, (x,))


class ViewWrittenInPlace(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x * 1
        if self.form == "relu_":           # an in-place function between the view and its reader
            v = y.transpose(0, 1)
            torch.relu_(y)
            return v @ self.w
        if self.form == "inplace_kwarg":
            v = y.transpose(0, 1)
            F.relu(y, inplace=True)
            return v @ self.w
        v = y[:, :4]                       # reshape of this slice is a view of y ...
        r = v.reshape(2, 2, 4)
        o = v @ self.w
        if self.form == "write_base_after":  # ... so a later write into y reaches r
            y.mul_(2)
            return r, o
        if self.form == "write_reshape_after":  # ... and a write into r reaches y
            r.add_(1)
            return y, o
        raise ValueError(self.form)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("form", ["relu_", "inplace_kwarg", "write_base_after", "write_reshape_after"])
def test_make_contiguous_keeps_writes_visible(form, front_end):
    model = ViewWrittenInPlace(form)
    x = torch.randn(4, 4 if form in ("relu_", "inplace_kwarg") else 8)
    cap, _ = rewrite(model, (x,), "make_contiguous", front_end=front_end)
    _same_no_grad(model, cap, (x,))


class LinearThenView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(100, 200)

    def forward(self, x):
        y = self.fc(x)
        return y.view(-1), y


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_pad_output_keeps_its_layout(front_end):
    # the narrowed N columns of the padded product were a strided view: .view() raised, and the
    # output came back non-contiguous (a caller's .view() raised too)
    model, x = LinearThenView(), torch.randn(4, 3, 100)
    cap, sites = rewrite(model, (x,), "pad_to_alignment", front_end=front_end)
    assert len(sites) == 1
    got = _same_no_grad(model, cap, (x,))
    assert got[1].is_contiguous()


class TwoLinearsInputWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(100, 200), nn.Linear(100, 200)

    def forward(self, x):
        y = x * 1
        o1 = self.a(y)
        y.add_(1)
        return o1, self.b(y)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_pad_does_not_share_a_padded_input_across_a_write(front_end):
    model, x = TwoLinearsInputWritten(), torch.randn(3, 100)
    cap, sites = rewrite(model, (x,), "pad_to_alignment", front_end=front_end)
    assert len(sites) == 2
    _same_no_grad(model, cap, (x,))


class BroadcastBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(200, 100))
        self.b1, self.b0 = nn.Parameter(torch.randn(1)), nn.Parameter(torch.randn(()))

    def forward(self, x):
        return F.linear(x, self.w, self.b1), F.linear(x, self.w, self.b0)


class ByKeyword(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.randn(200, 100) if kind == "linear" else torch.randn(4, 3, 3, 3))

    def forward(self, x):
        if self.kind == "linear":
            return F.linear(input=x, weight=self.w)
        return F.conv2d(input=x, weight=self.w)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_pad_linear_with_a_broadcast_bias(front_end):
    # a (1,) or 0-d bias broadcasts over N; padded by N's padding it no longer did (raised)
    model, x = BroadcastBias(), torch.randn(3, 100)
    cap, _ = rewrite(model, (x,), "pad_to_alignment", front_end=front_end)
    _same_no_grad(model, cap, (x,))


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("kind,pass_name,x", [("linear", "pad_to_alignment", (3, 100)),
                                              ("conv", "to_channels_last", (2, 3, 8, 8))])
def test_gemm_and_conv_inputs_given_by_keyword(kind, pass_name, x, front_end):
    model, x = ByKeyword(kind), torch.randn(*x)
    cap, _ = rewrite(model, (x,), pass_name, front_end=front_end)  # raised IndexError
    _same_no_grad(model, cap, (x,))


class ConvThenView(nn.Module):
    """The classic CNN head: a conv output flattened with .view(), and sliced outputs."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 2)

    def forward(self, x):
        h = F.relu(self.c(x))
        return self.fc(h.view(h.size(0), -1)), h[0], h.unsqueeze(1)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_channels_last_output_viewed_or_sliced(front_end):
    model, x = ConvThenView(), torch.randn(2, 3, 8, 8)
    cap, sites = rewrite(model, (x,), "to_channels_last", front_end=front_end)  # .view raised
    assert len(sites) == 1
    got = _same_no_grad(model, cap, (x,))
    assert got[1].is_contiguous() and got[2].is_contiguous()  # as the model returns them


class ConvInputWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        h = x * 2
        h.add_(1)
        return self.c(h)


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_channels_last_converts_after_in_place_writes(front_end):
    model, x = ConvInputWritten(), torch.randn(2, 3, 8, 8)
    cap, sites = rewrite(model, (x,), "to_channels_last", front_end=front_end)
    assert len(sites) == 1
    _same_no_grad(model, cap, (x,))


class PositionsClampedInPlace(nn.Module):
    def forward(self, x):
        pos = torch.arange(x.size(1)) + 1
        torch.clamp_(pos, min=5)           # an in-place function, not a method
        return pos < 6, pos


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
def test_narrow_int64_declines_a_chain_written_by_an_in_place_function(front_end):
    # the write went into the int64 copy made for the output; the comparison read the int32
    # values unwritten
    model, x = PositionsClampedInPlace(), torch.randn(2, 7)
    cap, sites = rewrite(model, (x,), "narrow_int64", front_end=front_end)
    assert sites == []
    _same_no_grad(model, cap, (x,))
