"""The research beside the product (research/README.md): one recipe per study, each with its
rule, config, runner and the code only that study uses. It depends on `fedlora`; `fedlora`
never imports it (tests/test_architecture.py)."""
