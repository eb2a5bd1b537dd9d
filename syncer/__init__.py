"""Rollway: syncer."""
