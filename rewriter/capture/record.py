"""Record the real values that flow through named nodes of a graph during one run.

The gate measures a site's region on its own, fed the values the model really produces there
(masks, indices and scales are values that matter, not just shapes)::

    rec = Recorder({"add_3", "softmax_1"})
    out = rec.run(gm, args, kwargs)        # runs gm like gm(*args, **kwargs), recording
    rec.values["add_3"]                    # a Recorded: detached copy, requires_grad as seen

Model tensors (parameters and buffers, which a graph reads directly) are kept by reference,
not copied: nothing the gate runs writes into them (regions that write in place are never
measured alone, see rewriter.capture.region).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Interpreter, Node


@dataclass
class Recorded:
    value: Any
    requires_grad: bool = False


def _is_model_tensor(node: Node, value: Any) -> bool:
    return node.op == "get_attr" or node.meta.get("static_value") is value or isinstance(
        value, torch.nn.Parameter)


class RecordingDone(Exception):
    """Raised (by a ``then`` callback) once every recorder of a run has its values: the rest of
    the model's run would only repeat what a block graph already recorded at its first call."""


class Recorder:
    """Values of the nodes named in ``names``, from the next run of a graph; ``then()`` is
    called after that run (it may raise :class:`RecordingDone` to end the model's run)."""

    def __init__(self, names: set[str], then: Callable[[], None] | None = None) -> None:
        self.names = set(names)
        self.values: dict[str, Recorded] = {}
        self.then = then

    def run(self, gm: GraphModule, args: tuple, kwargs: dict) -> Any:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        flat = list(args)
        for n in placeholders[len(args):]:
            flat.append(kwargs[n.target] if n.target in kwargs else (n.args[0] if n.args else None))
        recorder = self

        class _Recording(Interpreter):
            def run_node(self, n: Node) -> Any:
                result = super().run_node(n)
                if n.name in recorder.names:
                    recorder._keep(n, result)
                return result

        out = _Recording(gm).run(*flat)
        if self.then is not None:
            self.then()
        return out

    def _keep(self, node: Node, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            rg = value.requires_grad and (value.is_floating_point() or value.is_complex())
            kept = value.detach() if _is_model_tensor(node, value) else value.detach().clone()
            self.values[node.name] = Recorded(kept, rg)
        else:
            self.values[node.name] = Recorded(value, False)
