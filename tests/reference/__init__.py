"""Executable references for kvroute's compiled core (tests only, not shipped)."""
