"""Rollway: bus."""
