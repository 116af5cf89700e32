"""One home for attention: the kernels, the backend choice applied to a model, and transformers models' implementations.

Nothing is imported here, so that importing one module of the package costs only that one."""
