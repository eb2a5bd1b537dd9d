"""MoE routers of a transformers model, and a recorder of the experts they pick.

transformers' sparse MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral) hold a router module
``block.gate`` whose forward returns ``(router_logits, top_k_weights, top_k_index)``
over the block's input flattened to ``[batch * seq, hidden]``, and the fused experts
module ``block.experts`` consumes the last two. Routing replay (docs/contracts.md,
"Routing") hooks exactly there: :class:`RouteCapture` (the sampler) reads
``top_k_index``; ``trainer.routing.RoutingReplay`` (the trainer) replaces it.

A route table is ``[tokens, moe_layers, top_k]`` expert ids, MoE layers in model order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Routers whose gate weights are softmax(logits) at the top-k experts, renormalised over
# them when ``norm_topk_prob`` (Mixtral always renormalises), cast to the logits' dtype.
# Routing replay reproduces that formula at other experts, so only these are accepted.
SUPPORTED_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def moe_routers(model: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The router of every sparse MoE block, in layer order (empty for a dense model)."""
    routers = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    unknown = sorted({type(r).__name__ for r in routers} - set(SUPPORTED_ROUTERS))
    if unknown:
        raise TypeError(f"MoE router {unknown[0]} is not supported for routing replay "
                        f"(supported: {', '.join(SUPPORTED_ROUTERS)})")
    return routers


def route_shape(routers: list["torch.nn.Module"]) -> tuple[int, int, int]:
    """(MoE layers, top_k, experts) of a model's routers."""
    tops = {(int(r.top_k), int(r.num_experts)) for r in routers}
    if len(tops) != 1:
        raise TypeError(f"MoE layers differ in (top_k, experts): {sorted(tops)}")
    top_k, experts = tops.pop()
    return len(routers), top_k, experts


class RouteCapture:
    """Records each router's ``top_k_index`` during a forward; :meth:`take` returns the
    forward's routes as ``[batch, seq, layers, top_k]`` int16."""

    def __init__(self, model: "torch.nn.Module") -> None:
        self.routers = moe_routers(model)
        self.layers, self.top_k, self.num_experts = route_shape(self.routers)
        self._picked: list["torch.Tensor | None"] = [None] * self.layers
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._picked[layer] = output[2].detach()
        return hook

    def take(self, batch: int, seq: int) -> np.ndarray:
        if any(p is None for p in self._picked):
            raise RuntimeError("a router did not run in this forward")
        import torch

        routes = torch.stack([p.reshape(batch, seq, self.top_k) for p in self._picked], dim=2)
        self._picked = [None] * self.layers
        return routes.to(torch.int16).cpu().numpy()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
