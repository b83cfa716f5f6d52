"""ZeRO stage 3 over units: partitioning, hooks, the fetcher, and the parameter and optimizer tiers."""
