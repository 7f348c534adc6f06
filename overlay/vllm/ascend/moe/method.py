"""Placeholder replaced below in this issue's MoE step."""
