"""Rollway: tasks."""
