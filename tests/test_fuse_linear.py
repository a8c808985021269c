import pytest
import torch
import torch.nn as nn

from tests.helpers import code, outputs_and_grads, rewrite
from tests.models import TransposedLinear


@pytest.mark.parametrize("front_end", ["fx", "dynamo"])
@pytest.mark.parametrize("form", ["matmul_t", "at_T", "transpose", "addmm"])
def test_fuses_and_keeps_outputs_and_grads(form, front_end):
    model = TransposedLinear(form)
    x = torch.randn(8, 32) if form == "addmm" else torch.randn(4, 8, 32)
    cap, sites = rewrite(model, (x,), "fuse_linear", front_end=front_end, training=True)
    assert len(sites) == 1
    src = code(cap)
    assert "linear" in src and "matmul" not in src and "addmm" not in src
    params = list(model.parameters())
    for got, want in zip(*[sum(outputs_and_grads(f, (x,), params), []) for f in (cap, model)]):
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


def test_tuning_guide_case_without_bias():
    """[256,1024] x [1024,256]: the transposed weight fed to matmul, no bias."""
    model = TransposedLinear("matmul_t", d_in=1024, d_out=256, bias=False)
    x = torch.randn(256, 1024)
    cap, sites = rewrite(model, (x,), "fuse_linear")
    assert len(sites) == 1 and "linear" in code(cap)
    torch.testing.assert_close(cap(x), model(x), rtol=1e-5, atol=1e-5)


def test_declines_when_matmul_result_is_used_elsewhere():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(4))

        def forward(self, x):
            y = x @ self.w.t()
            return y + self.b, y.relu()
    cap, sites = rewrite(Shared(), (torch.randn(3, 8),), "fuse_linear")
    # The bias add cannot absorb a matmul that has a second user; the bare matmul still fuses.
    assert [s.description.split(":")[0] for s in sites] == ["matmul"]
    assert "+ b" in code(cap) or "add" in code(cap)


def test_declines_bias_that_broadcasts_over_rows():
    class RowBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return torch.matmul(x, self.w.t()) + self.b
    model = RowBias()
    x = torch.randn(3, 8)
    cap, sites = rewrite(model, (x,), "fuse_linear")
    assert len(sites) == 1 and "with bias" not in sites[0].description  # bias stays an add
    torch.testing.assert_close(cap(x), model(x))


def test_declines_batched_weight():
    class Batched(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 4, 8))

        def forward(self, x):
            return torch.matmul(x, self.w.transpose(-1, -2))
    cap, sites = rewrite(Batched(), (torch.randn(2, 3, 8),), "fuse_linear")
    assert sites == []


def test_declines_addmm_with_beta_alpha():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(4, 8)), nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.addmm(self.b, x, self.w.t(), beta=0.5)
    cap, sites = rewrite(Scaled(), (torch.randn(3, 8),), "fuse_linear")
    assert sites == []
