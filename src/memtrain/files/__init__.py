"""Files memtrain reads and writes: atomic results, the append-only stores, the folder lock, which files may be opened.

Nothing is imported here, so that importing one module of the package costs only that one."""
