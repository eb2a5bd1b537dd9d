"""An OpenAI-compatible endpoint on a sampler replica, for agent harnesses that run the
episode themselves while Rollway records the exact token ids (docs/agents.md)."""
