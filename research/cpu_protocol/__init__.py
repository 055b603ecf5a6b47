"""The CPU protocol and its confirmations (README.md here)."""
