"""What a run is, torch-free: the typed configuration, its flags and aliases, model presets.

Nothing is imported here, so that importing one module of the package costs only that one."""
