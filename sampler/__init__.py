"""Rollway: sampler."""
