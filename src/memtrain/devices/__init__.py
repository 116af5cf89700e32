"""One home for device facts: what this device does natively, GPU kinds, their memory and FLOP rates, precision numerics.

Nothing is imported here, so that importing one module of the package costs only that one."""
