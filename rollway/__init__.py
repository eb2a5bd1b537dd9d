"""Rollway: rollway."""
