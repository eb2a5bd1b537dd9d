"""MoE routing replay (R3): the trainer routes each position to the experts the sampler
routed it to, instead of recomputing its own top-k.

A forward hook on every router (``sampler.routes.moe_routers``) rewrites the router's
output ``(logits, top_k_weights, top_k_index)`` before the experts read it:

* ``top_k_index``: the recorded experts where the position has a route, the trainer's
  own top-k elsewhere (unrecorded positions, padding);
* ``top_k_weights``: the router's own gating formula evaluated at those experts,
  ``softmax(logits)[experts]``, renormalised over them where the model renormalises
  (``norm_topk_prob``; Mixtral always), in the model's dtype. The logits keep their
  graph, so the router still learns through the gate weights of the experts the
  sampler used (docs/contracts.md, "Routing"). At a position whose recorded experts are
  the trainer's own, the result is bit-identical to the unhooked router.

Routes come per forward (:meth:`RoutingReplay.using`) as ``[rows, L, layers, top_k]``,
the layout of ``MicroBatch.routes``; the router sees the block input flattened to
``[rows * L, hidden]``. Whether replay is on or off, the hook counts the recorded
positions whose recomputed experts (as sets) differ from the recorded ones in any layer:
the ``routing_differs_frac`` metric. With replay on, layer l's recomputation sees the
replayed layers before it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class RoutingReplay:
    def __init__(self, model: torch.nn.Module, replay: bool) -> None:
        from sampler.routes import moe_routers, route_shape

        self.routers = moe_routers(model)
        self.shape = route_shape(self.routers) if self.routers else None  # (layers, top_k, experts)
        self.replay = replay
        self._routes: torch.Tensor | None = None  # [rows * L, layers, top_k] long
        self._differs: torch.Tensor | None = None  # [rows * L] bool, any layer
        self.recorded_positions = 0
        self.differing_positions = 0
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @contextmanager
    def using(self, routes: torch.Tensor) -> Iterator[None]:
        """Replay ``routes`` ([rows, L, layers, top_k], -1 = none; empty = none at all)
        in the forwards inside the block; counts go to the totals on exit."""
        if self.shape is None or routes.numel() == 0:
            yield
            return
        rows, length = routes.shape[:2]
        self._routes = routes.reshape(rows * length, *routes.shape[2:]).long()
        self._differs = self._routes.new_zeros(rows * length, dtype=bool)
        try:
            yield
            recorded = self._routes[:, 0, 0] >= 0
            self.recorded_positions += int(recorded.sum())
            self.differing_positions += int((self._differs & recorded).sum())
        finally:
            self._routes = self._differs = None

    def take_counts(self) -> tuple[int, int]:
        """(recorded positions, positions routed differently) since the last call."""
        counts = (self.recorded_positions, self.differing_positions)
        self.recorded_positions = self.differing_positions = 0
        return counts

    def _hook(self, layer: int):
        def hook(router, args, output):
            if self._routes is None:
                return None
            logits, weights, index = output
            recorded = self._routes[:, layer, :].to(index.device)
            has_route = recorded[:, 0] >= 0
            differs = (recorded.sort(dim=1).values != index.sort(dim=1).values).any(dim=1)
            self._differs |= (differs & has_route).to(self._differs.device)
            if not self.replay:
                return None
            experts = torch.where(has_route.unsqueeze(1), recorded, index)
            gates = logits.softmax(dim=-1, dtype=torch.float32).gather(1, experts)
            if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
                gates = gates / gates.sum(dim=-1, keepdim=True)
            return logits, gates.to(weights.dtype), experts
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

