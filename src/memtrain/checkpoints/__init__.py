"""One home for training checkpoints: single-process files, distributed directories, safe DCP reading.

Nothing is imported here, so that importing one module of the package costs only that one."""
