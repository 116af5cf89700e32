"""The training run: the step harness, the loop, checks before the first step, live logs.

Nothing is imported here, so that importing one module of the package costs only that one."""
