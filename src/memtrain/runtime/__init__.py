"""The process around a run: environment facts, signals, notices, optional packages.

Nothing is imported here, so that importing one module of the package costs only that one."""
