"""The policy's logits at the loss positions, optionally in the samplers' precision.

Precision replay (``trainer.replay_precision``): samplers serve the published copy of
the weights (``publish_dtype``, e.g. bfloat16) while the trainer keeps float32 masters.
With replay on, the forward runs on the masters cast to that dtype (``torch.func.
functional_call`` substitutes the cast tensors for the parameters), so the trainer's
log-probs are computed at the precision the tokens were sampled at; the casts are
differentiable, so the gradients land on the float32 masters and the optimizer is
unchanged. Buffers (rotary frequencies) stay as they are, as in a sampler's loaded copy.
"""

from __future__ import annotations

import torch
from torch.func import functional_call


class SelectedLogits(torch.nn.Module):
    """The policy's logits at chosen (row, position) pairs: the head runs only where a
    loss token needs it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=input_ids).last_hidden_state
        return self.model.get_output_embeddings()(hidden[row, pos])


def policy_logits(selected: SelectedLogits, input_ids: torch.Tensor, row: torch.Tensor, pos: torch.Tensor,
                  replay_dtype: torch.dtype | None) -> torch.Tensor:
    """float32 logits; ``replay_dtype``: run the forward on the weights cast to it."""
    if replay_dtype is None:
        return selected(input_ids, row, pos).float()
    cast = {f"model.{name}": p.to(replay_dtype) for name, p in selected.model.named_parameters()}
    # Tied weights (lm_head = embed_tokens) stay tied: functional_call ties by default.
    return functional_call(selected, cast, (input_ids, row, pos)).float()
