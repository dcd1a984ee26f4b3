"""The simulator: the production scheduler and engine loop on a virtual clock and a cost model."""
