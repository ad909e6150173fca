"""kvroute."""
