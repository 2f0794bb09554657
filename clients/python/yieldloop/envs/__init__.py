"""Environments shipped with yieldloop (the demo's task family lives here)."""
