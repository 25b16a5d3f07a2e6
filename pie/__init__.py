"""Pie: a programmable LLM serving system."""

__version__ = "0.1.0"
