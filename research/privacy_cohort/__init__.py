"""The privacy trade-off at N = 1,000 clients (research/privacy_cohort/privacy_cohort.md)."""
