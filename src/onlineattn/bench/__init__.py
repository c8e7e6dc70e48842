"""Measurement helpers and the `onlineattn bench` command."""
