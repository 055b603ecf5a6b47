"""The privacy trade-off study (README.md here)."""
