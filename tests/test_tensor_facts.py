"""Tensor facts of nodes a pass adds (rewriter.capture.ir.fill_missing_info), without real compute."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import symbolic_trace

from rewriter.capture.ir import TensorInfo, annotate_tensor_info, fill_missing_info, tensor_info


class Attn(nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
        peak = scores.abs().max().item()  # data-dependent: fake tensors cannot run it
        return (scores / peak).softmax(-1) @ v


def _annotated():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    gm = symbolic_trace(Attn())
    annotate_tensor_info(gm, (q, k, v), {})
    return gm, (q, k, v)


def _add_sdpa(gm):
    """What a pass does: new nodes, no facts; one of them reads the other."""
    g = gm.graph
    q, k, v = [n for n in g.nodes if n.op == "placeholder"]
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        sdpa = g.call_function(F.scaled_dot_product_attention, (q, k, v))
        flat = g.call_method("flatten", (sdpa, 2))
    old = out.args[0]
    out.args = ((old, flat),)
    gm.recompile()
    return sdpa, flat


def test_new_nodes_get_the_facts_a_real_run_gives():
    gm, args = _annotated()
    sdpa, flat = _add_sdpa(gm)
    # a whole-graph propagation stops at .item() (data-dependent), before the new nodes: their
    # facts come from running them alone, on their inputs' facts
    fill_missing_info(gm)
    real_sdpa = F.scaled_dot_product_attention(*args)
    assert tensor_info(sdpa) == TensorInfo.of(real_sdpa)
    assert tensor_info(flat) == TensorInfo.of(real_sdpa.flatten(2))


def test_a_node_whose_facts_are_gone_is_run_again_from_its_inputs():
    gm, args = _annotated()
    sdpa, flat = _add_sdpa(gm)
    softmax = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "softmax")
    softmax.meta.pop("tensor_info")
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        reader = g.call_method("sum", (softmax, -1))
    out.args = ((*out.args[0], reader),)
    gm.recompile()
    fill_missing_info(gm)
    q, k, v = args
    scores = q @ k.transpose(-1, -2) / 4.0
    real = (scores / scores.abs().max()).softmax(-1)
    assert tensor_info(softmax) == TensorInfo.of(real)
    assert tensor_info(reader) == TensorInfo.of(real.sum(-1))
    assert tensor_info(sdpa) == TensorInfo.of(F.scaled_dot_product_attention(q, k, v))


def test_what_depends_on_a_data_dependent_value_stays_unknown_and_the_rest_is_filled():
    gm, args = _annotated()
    sdpa, _ = _add_sdpa(gm)
    item = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "item")
    divided = next(iter(item.users))
    item.meta.pop("host_scalar")
    divided.meta.pop("tensor_info")  # needs .item()'s value, which fake tensors cannot give
    fill_missing_info(gm)
    assert tensor_info(divided) is None
    assert tensor_info(sdpa) == TensorInfo.of(F.scaled_dot_product_attention(*args))
