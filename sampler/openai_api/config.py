"""Settings of the OpenAI-compatible endpoint (``sampler.endpoint``)."""

from __future__ import annotations

import msgspec


class EndpointConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Serve /v1/chat/completions and the episode API from the sampler replica.
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8400
    # The model name harnesses ask for; "" = the run's model_name. Any other name is a 404.
    served_model_name: str = ""
    # Episodes open at once on this replica (each holds a sandbox session).
    max_episodes: int = 64
    # An episode without a request this long is abandoned: its sandbox session is
    # closed and it is never graded (its trajectory has no final chunk, like a
    # rollout of a replica that died).
    episode_idle_timeout_s: float = 1800.0
    # Episode budgets (the harness runs the loop; these bound what one episode samples).
    max_turns: int = 64
    max_total_tokens: int = 16384
    # A request without max_tokens samples at most this many (and never past the context).
    default_max_tokens: int = 512

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port < 65536, f"sampler.endpoint.port must be in [0, 65535], got {self.port}"),
            (self.max_episodes >= 1, f"sampler.endpoint.max_episodes must be >= 1, got {self.max_episodes}"),
            (self.episode_idle_timeout_s > 0, "sampler.endpoint.episode_idle_timeout_s must be > 0"),
            (self.max_turns >= 1 and self.max_total_tokens >= 1 and self.default_max_tokens >= 1,
             "sampler.endpoint.max_turns, max_total_tokens and default_max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
