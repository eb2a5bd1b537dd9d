"""Example consumers built with :mod:`bus.analytics`."""
