"""Rollway: sandbox."""
