"""Rollway: trainer."""
