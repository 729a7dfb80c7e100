"""Patch definitions and the code that applies, verifies and reverts them."""
