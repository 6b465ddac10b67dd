"""Typed fakes shared by tests: small stand-ins that speak the real protocols."""
