"""The references study (README.md here)."""
