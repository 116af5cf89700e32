"""Using a trained model: export as a transformers directory and sampling.

Nothing is imported here, so that importing one module of the package costs only that one."""
