"""Shared test helpers (checkpoint builders, reference models)."""
